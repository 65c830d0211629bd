"""A hybrid model (full-attention and sliding-window layers) with vLLM 0.33's hybrid
memory allocator on: what is stored (every page of the full-attention group, only the
window before the end of the sliding-window group), that the next turn restores both
byte for byte, and the KV cache groups refused at start-up."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_planning", reason="needs vLLM 0.33's scheduler")

import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from sparkcache.store.objects import HEADER_SIZE
from sparkcache.store.reader import StoreReader
from sparkcache.vllm import kv_groups
from tests.with_vllm.harness import BLOCK, HEAD, KV_HEADS, request, rig
from tests.with_vllm.test_connector_scheduler import (
    load_turn,
    object_of,
    run_turn,
    running_supervisor,
    stored_keys,
)

WINDOW = 32  # tokens: a resumed request needs the 2 pages before where it resumes
WINDOW_PAGES = 2


def wait_root_of(store: Path, pages: int) -> list[str]:
    """The keys of the root of ``pages`` pages once it is stored."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = [keys for keys in stored_keys(store, 0) if len(keys) == pages]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no root of {pages} pages: {[len(k) for k in stored_keys(store, 0)]}")


def check_restored(r, rid: str, prefix: list[int], pages: int) -> None:
    """The blocks ``rid``'s load wrote, its first ``pages`` pages of the full-attention
    group then the window before them of the sliding-window group, hold what a forward
    pass writes there."""
    loaded = r.loads[rid]
    assert len(loaded) == pages + WINDOW_PAGES
    for i, block in enumerate(loaded):
        page, group = (i, 0) if i < pages else (pages - WINDOW_PAGES + i - pages, 1)
        tokens = prefix[page * BLOCK:(page + 1) * BLOCK]
        assert block != kv_groups.NULL_BLOCK
        assert r.block_holds(0, block, tokens, page * BLOCK, group=group), (page, group)


@pytest.mark.parametrize("stride", [0, 4])
def test_a_hybrid_model_stores_the_window_and_restores_it_exactly(
        tmp_path: Path, instance: str, stride: int) -> None:
    """Stride 0: saved once, at the end, from vLLM's own block ids. Stride 4: saved as it
    runs too (chunks of 256 tokens), from the block ids the scheduler's outputs gave,
    every save of the request replacing the last (its windows with it)."""
    prefix = list(range(10, 10 + 40 * BLOCK))  # 40 full pages
    with running_supervisor(tmp_path / "store", instance) as store, \
            rig(store, instance, sliding_window=WINDOW,
                extra={"save_stride_pages": stride}) as r:
        side = r.sched.get_kv_connector()._scheduler
        assert side.groups is not None and r.workers[0]._worker.groups is not None
        run_turn(r, "A", [*prefix, 7, 8, 9])
        # 40 pages of the full-attention group and the last 2 of the window's: one root.
        root = wait_root_of(store, 40 + WINDOW_PAGES)
        assert len(stored_keys(store, 0)) == 1
        # The window group's pages are its own keys, not the full-attention group's.
        assert not set(root[40:]) & set(root[:40])
        if stride:
            assert side.counters["partial_saves"] >= 2, side.counters
        load_turn(r, "B", [*prefix, *range(300, 310)])
        assert not r.load_errors
        check_restored(r, "B", prefix, 40)
        r.run_until_idle()
        assert side.totals()["hit_tokens"] == 40 * BLOCK


def test_with_a_draft_model_prefixes_are_saved_not_loaded(
        tmp_path: Path, instance: str, caplog: pytest.LogCaptureFixture) -> None:
    """A draft model drops a hit's last page (vLLM's prefix cache does too), and the
    window before the page left starts a page before any save's: never stored whole, so
    no load is offered (counted), and the start-up log says so."""
    prefix = list(range(10, 10 + 20 * BLOCK))
    with caplog.at_level(logging.WARNING, logger="sparkcache"), \
            running_supervisor(tmp_path / "store", instance) as store, \
            rig(store, instance, sliding_window=WINDOW, extra={"save_stride_pages": 0},
                draft=True) as r:
        side = r.sched.get_kv_connector()._scheduler
        assert side.settings.drop_last_page
        run_turn(r, "A", [*prefix, 7])
        wait_root_of(store, 20 + WINDOW_PAGES)
        run_turn(r, "B", [*prefix, *range(300, 310)])
        assert not r.loads and side.totals()["skipped:lookup_draft_window"] == 2  # A, B
    assert any("saved but not loaded" in rec.getMessage() for rec in caplog.records)


def test_a_turn_whose_window_is_not_stored_computes(tmp_path: Path, instance: str) -> None:
    """A prefix whose full-attention pages are stored (a longer conversation's) but with
    no window stored where this turn's stored prefix ends is not loaded: without the
    window, its next tokens' sliding-window attention would read blocks never filled."""
    prefix = list(range(10, 10 + 12 * BLOCK))
    with running_supervisor(tmp_path / "store", instance) as store, \
            rig(store, instance, sliding_window=WINDOW, extra={"save_stride_pages": 0}) as r:
        run_turn(r, "A", [*prefix, *range(500, 500 + 8 * BLOCK), 1])  # 20 pages stored
        wait_root_of(store, 20 + WINDOW_PAGES)
        # B shares A's first 12 pages and differs after: no window ends at page 12.
        r.sched.add_request(request("B", [*prefix, *range(700, 720)], max_tokens=2))
        r.run_until_idle()
        side = r.sched.get_kv_connector()._scheduler
        assert "B" not in r.loads and side.counters["lookup_window_not_stored"] >= 1
        assert side.totals()["hit_tokens"] == 0
        # The read lease B's lookup took on A's root is released, not left to expire
        # (lookup_lease_seconds: 30 s).
        reader = StoreReader(store, 0)
        try:
            deadline = time.monotonic() + 10
            while reader.conn.execute("SELECT count(*) FROM reads").fetchone()[0]:
                assert time.monotonic() < deadline, "a read lease left"
                r.step()
                time.sleep(0.05)
        finally:
            reader.close()


def test_a_page_that_fails_verification_fails_the_load_by_request(
        tmp_path: Path, instance: str) -> None:
    """vLLM takes no block-level load errors from a model with several KV cache groups
    (it raises): the request is reported failed, vLLM computes its whole prompt, and it
    is not offered another load."""
    prefix = list(range(10, 10 + 8 * BLOCK))
    with running_supervisor(tmp_path / "store", instance) as store, \
            rig(store, instance, sliding_window=WINDOW, extra={"save_stride_pages": 0}) as r:
        run_turn(r, "A", [*prefix, 1])
        root = wait_root_of(store, 8 + WINDOW_PAGES)
        path, offset = object_of(store, 0, root[-1])  # the window's last page
        data = bytearray(path.read_bytes())
        data[offset + HEADER_SIZE + 17] ^= 0xFF
        path.write_bytes(bytes(data))
        load_turn(r, "B", [*prefix, 2, 3])
        assert r.failed_recving == {"B"} and not r.load_errors
        loads = dict(r.loads)
        r.run_until_idle()  # B computed whole, no error raised, no load again
        assert r.loads == loads and r.sched.requests == {}


def _config(*specs) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{i}.attn"], spec) for i, spec in enumerate(specs)])


def _spec(cls, **kw):
    return cls(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float16,
               **kw)


def test_kv_cache_groups_supported_and_refused() -> None:
    full = _spec(FullAttentionSpec)
    window = _spec(SlidingWindowSpec, sliding_window=4096)
    groups = kv_groups.from_kv_cache_config(_config(window, full, window), BLOCK)
    assert [(g.index, g.kind, g.window_pages) for g in groups.groups] == [
        (1, "full", 0), (0, "sliding_window", 256), (2, "sliding_window", 256)]
    assert not kv_groups.from_kv_cache_config(_config(full), BLOCK).hybrid
    # A composite: the anchor's keys, then each window's own, with their blocks.
    two = kv_groups.from_kv_cache_config(
        _config(full, _spec(SlidingWindowSpec, sliding_window=2 * BLOCK)), BLOCK)
    anchor = b"".join(bytes([i]) * 16 for i in range(6))
    tables = [[1, 2, 3, 4, 5, 6], [0, 0, 0, 7, 8, 9]]
    comp = two.composite(anchor, 0, 6, tables)
    assert comp.keys[:6 * 16] == anchor and comp.blocks == [1, 2, 3, 4, 5, 6, 8, 9]
    assert comp.keys[6 * 16:] == b"".join(
        kv_groups.group_key(anchor[i * 16:(i + 1) * 16], 1) for i in (4, 5))
    assert two.composite(anchor, 5, 6, tables).blocks == [6, 9]
    assert two.windows_held(tables, 6) and not two.windows_held(tables, 4)
    # Tracked from the scheduler's outputs as of 96 tokens computed, vLLM has freed the
    # blocks below page (96 - 32 + 1) // 16 = 4: pages 4-5 are held; as of 111, page 4
    # is not, whatever the tracked table says.
    assert two.windows_held(tables, 6, computed=96)
    assert not two.windows_held(tables, 6, computed=111)
    refused = {
        "CrossAttentionSpec": _config(full, _spec(CrossAttentionSpec)),
        "ChunkedLocalAttentionSpec": _config(
            full, _spec(ChunkedLocalAttentionSpec, attention_chunk_size=64)),
        "every layer has sliding-window attention": _config(window),
        "blocks of 32 tokens": _config(full, SlidingWindowSpec(
            block_size=32, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float16,
            sliding_window=64)),
    }
    for named, config in refused.items():
        with pytest.raises(kv_groups.UnsupportedGroups, match=named) as refusal:
            kv_groups.from_kv_cache_config(config, BLOCK)
        # The remedy: vLLM's hybrid allocator off where that serves the model.
        serves = named in ("ChunkedLocalAttentionSpec", "blocks of 32 tokens")
        assert ("--disable-hybrid-kv-cache-manager" in str(refusal.value)) == serves, named
        assert ("without the SparkCache connector" in str(refusal.value)) != serves, named


def test_a_model_with_groups_it_cannot_store_disables_sparkcache_with_one_line(
        tmp_path: Path, instance: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The line names the group and the remedy; vLLM serves on without the cache."""
    def refuse(*_):
        raise kv_groups.UnsupportedGroups(
            "KV cache group 1 is CrossAttentionSpec: start vLLM with "
            "--disable-hybrid-kv-cache-manager ...")
    from sparkcache.vllm import connector
    monkeypatch.setattr(connector.kv_groups, "from_kv_cache_config", refuse)
    with caplog.at_level(logging.ERROR, logger="sparkcache"), \
            rig(tmp_path / "store", instance) as r:
        conn = r.sched.get_kv_connector()
        assert conn._scheduler is None and conn.faults["init"] == 1
        run_turn(r, "A", list(range(10, 10 + 3 * BLOCK)))  # served, without the cache
    lines = [rec.getMessage() for rec in caplog.records if "disabled" in rec.getMessage()]
    assert len(lines) == 1 + 1  # the scheduler's and the worker's sides, once each
    assert "CrossAttentionSpec" in lines[0] and "--disable-hybrid-kv-cache-manager" in lines[0]
