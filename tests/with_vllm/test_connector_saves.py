"""Saves while a request runs, at its preemption, and vLLM waiting for held blocks rather
than preempting: vLLM 0.33's real Scheduler, the worker-side connector and a real
supervisor (``harness``)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.pipeline_util import start_supervisor, stop_supervisor

pytest.importorskip("vllm.v1.core.kv_cache_planning", reason="needs vLLM 0.33's scheduler")

from sparkcache.workers.lifecycle import Role
from vllm.v1.request import RequestStatus

from tests.with_vllm.harness import BLOCK, request, rig
from tests.with_vllm.test_connector_scheduler import prefix_keys

# Short, so that a publication capture never takes ends soon; capture and the connector
# must compute the same deadline.
RELEASE_S = "3"


@pytest.fixture
def supervisor(tmp_path: Path, instance: str) -> Iterator[Path]:
    proc = start_supervisor(tmp_path / "store", instance, "--release-timeout-seconds",
                            RELEASE_S)
    try:
        yield tmp_path / "store"
    finally:
        code, err = stop_supervisor(proc)
        assert code == 0, err[-2000:]


def stored_pages(r, keys: list[str]) -> int:
    """Pages of ``keys`` every rank's store holds (a lookup, as the next turn's)."""
    side = r.sched.get_kv_connector()._scheduler
    return side.lookup.lookup(keys, beyond=0)


def wait_pages(r, keys: list[str], pages: int, timeout: float = 30.0) -> None:
    """Without stepping the engine: capture and commit go on by themselves."""
    deadline = time.monotonic() + timeout
    while stored_pages(r, keys) < pages:
        if time.monotonic() > deadline:
            raise AssertionError(f"{pages} pages not stored within {timeout:g} s")
        time.sleep(0.05)


@contextmanager
def capture_stopped(r) -> Iterator[None]:
    """Capture's process stopped: publications wait for it (up to their deadline)."""
    client = r.workers[0]._worker.client
    pid = int(client._connection().stats.read(int(Role.CAPTURE)).pid)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_long_prefill_is_published_while_it_runs(supervisor: Path, instance: str) -> None:
    """Two pages a step (32 tokens batched), a save every two pages: the store holds the
    prefill's first pages while the request is still prefilling, and all of its pages
    once it finished."""
    prompt = list(range(1000, 1000 + 12 * BLOCK + 3))
    with rig(supervisor, instance, max_batched=2 * BLOCK,
             extra={"save_stride_pages": 2, "release_timeout_seconds": RELEASE_S}) as r:
        r.sched.add_request(request("A", prompt, max_tokens=2))
        r.step()
        keys = prefix_keys(supervisor, prompt)
        side = r.sched.get_kv_connector()._scheduler
        while not side.counters["partial_saves"]:
            r.step()
        req = r.sched.requests["A"]
        assert req.status == RequestStatus.RUNNING and req.is_prefill_chunk
        computed = req.num_computed_tokens
        wait_pages(r, keys, 2)  # published while the prefill runs
        assert r.sched.requests["A"].num_computed_tokens == computed  # not stepped since
        r.run_until_idle()
        assert "A" in r.finished_sending
        assert side.counters["partial_saves"] >= 3, side.counters
        wait_pages(r, keys, 12)
        assert r.workers[0]._worker.client.pending == 0


def test_a_preempted_request_is_saved_before_its_blocks_are_reused(
        supervisor: Path, instance: str) -> None:
    """Fifteen blocks, two requests growing past them: vLLM preempts the later one. Its
    computed pages are published and copied before handle_preemptions returns (no
    publication of it is pending then, so no capture reads the blocks the next forward
    writes), they are in the store, and the request, resumed, loads them byte-exact."""
    prompt_a = list(range(2000, 2000 + 5 * BLOCK))
    prompt_b = list(range(3000, 3000 + 5 * BLOCK))
    with rig(supervisor, instance, num_blocks=16,
             extra={"save_stride_pages": 0, "release_timeout_seconds": RELEASE_S}) as r:
        worker = r.workers[0]
        client = worker._worker.client
        preempted: list[tuple[str, list[int], list[int]]] = []
        real = worker.handle_preemptions

        def handle_preemptions(meta) -> None:
            real(meta)
            for job in meta.preempted:
                req = r.sched.requests[job.req_id]
                assert not [p for p in client._pending.values() if p.seq_id == job.req_id]
                preempted.append((job.req_id, list(req.all_token_ids), job.block_ids))

        worker.handle_preemptions = handle_preemptions
        r.sched.add_request(request("A", prompt_a, max_tokens=80))
        r.sched.add_request(request("B", prompt_b, max_tokens=80))
        deadline = time.monotonic() + 60
        while not preempted:
            assert time.monotonic() < deadline and r.sched.requests, "nothing preempted"
            r.step()
        rid, tokens, blocks = preempted[0]
        assert rid == "B" and len(blocks) > 5  # prompt pages and decoded ones
        keys = prefix_keys(supervisor, tokens)[: len(blocks)]
        # Durable soon after: the copy was done before the blocks went.
        wait_pages(r, keys, len(blocks))
        side = r.sched.get_kv_connector()._scheduler
        assert side.counters["preemption_saves"] == 1
        r.run_until_idle()
        assert not r.load_errors
        loaded = r.loads["B"]  # resumed: its prompt's pages came back from the store
        assert len(loaded) == (len(prompt_b) - 1) // BLOCK  # a prompt token left to compute
        for page, block in enumerate(loaded):
            # Overwritten by the forward since if the load had been wrong; checked as
            # loaded: the bytes the forward writes for these tokens.
            assert r.block_holds(0, block, tokens[page * BLOCK:(page + 1) * BLOCK],
                                 page * BLOCK), f"page {page} not restored exactly"


def _held_blocks_scenario(r, base: int) -> tuple[int, int]:
    """Fifteen blocks: A (7) finishes while capture is stopped, its blocks held for its
    save; B and C (4 each) then need a fifth the pool does not have. Returns the
    preemptions, and the steps that scheduled nothing meanwhile. ``base``: the first
    token (tokens no earlier run stored)."""
    r.sched.add_request(request("A", list(range(base, base + 6 * BLOCK)), max_tokens=1))
    r.sched.add_request(request("B", list(range(base + 1000, base + 1000 + 4 * BLOCK - 1)),
                                max_tokens=4))
    r.sched.add_request(request("C", list(range(base + 2000, base + 2000 + 4 * BLOCK - 1)),
                                max_tokens=4))
    reqs = {rid: r.sched.requests[rid] for rid in "ABC"}
    waited = 0
    with capture_stopped(r):
        for _ in range(6):
            so = r.step()
            if "A" not in r.sched.requests or "A" in r.finished_sending:
                break
            if not so.num_scheduled_tokens:
                waited += 1
    r.run_until_idle()
    assert "A" in r.finished_sending
    return sum(req.num_preemptions for req in reqs.values()), waited


def test_held_blocks_make_vllm_wait_rather_than_preempt(
        supervisor: Path, instance: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished request's blocks held for its save (capture stopped) while running
    requests need them: answered by has_pending_block_frees, vLLM waits for the save and
    preempts nothing. The same scenario with the answer withheld preempts."""
    extra = {"save_stride_pages": 0, "release_timeout_seconds": RELEASE_S}
    with rig(supervisor, instance, num_blocks=16, extra=extra) as r:
        side = r.sched.get_kv_connector()._scheduler
        preemptions, waited = _held_blocks_scenario(r, 10000)
        assert preemptions == 0 and waited >= 1, (preemptions, waited)
        # A, B and C each held for its save, A for as long as capture was stopped.
        assert side.counters["held_requests"] == 3 and side.counters["held_seconds"] > 0
    with rig(supervisor, instance, num_blocks=16, extra=extra) as r:
        side = r.sched.get_kv_connector()._scheduler
        monkeypatch.setattr(side, "has_pending_block_frees", lambda: False)
        preemptions, _ = _held_blocks_scenario(r, 20000)
        assert preemptions >= 1


@pytest.mark.parametrize("bad", [-1, "2.5", "many", True])
def test_a_bad_save_stride_is_refused_naming_what_is_allowed(tmp_path: Path, bad) -> None:
    from types import SimpleNamespace

    from sparkcache.vllm import settings

    def config(stride) -> SimpleNamespace:
        extra = {"store_dir": str(tmp_path), "save_stride_pages": stride}
        return SimpleNamespace(
            kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
            cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="bfloat16"),
            model_config=SimpleNamespace(model="m", revision=None),
            parallel_config=SimpleNamespace(tensor_parallel_size=1))

    assert settings.from_vllm(config(0)).save_stride_pages == 0
    assert settings.from_vllm(config("8")).save_stride_pages == 8
    with pytest.raises(ValueError, match=r"save_stride_pages .*non-negative integer"):
        settings.from_vllm(config(bad))


def test_a_page_size_other_than_the_block_size_is_named_and_the_block_size_kept(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A page is one vLLM block; a page size set otherwise (the connector's config or
    SPARKCACHE_PAGE_TOKENS) was replaced without a word."""
    from types import SimpleNamespace

    from sparkcache.vllm import settings

    def config(**extra: object) -> SimpleNamespace:
        return SimpleNamespace(
            kv_transfer_config=SimpleNamespace(
                kv_connector_extra_config={"store_dir": str(tmp_path), **extra}),
            cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="bfloat16"),
            model_config=SimpleNamespace(model="m", revision=None),
            parallel_config=SimpleNamespace(tensor_parallel_size=1))

    with caplog.at_level("WARNING"):
        assert settings.from_vllm(config(page_tokens=2 * BLOCK)).cfg.page_tokens == BLOCK
        assert settings.from_vllm(config(page_tokens=BLOCK)).cfg.page_tokens == BLOCK
        monkeypatch.setenv("SPARKCACHE_PAGE_TOKENS", "64")
        assert settings.from_vllm(config()).cfg.page_tokens == BLOCK
    assert [m for m in caplog.messages if "page_tokens" in m] == [
        f"SparkCache: page_tokens {2 * BLOCK} ignored: a page is one vLLM block, {BLOCK} "
        "tokens here (--block-size)",
        f"SparkCache: page_tokens 64 ignored: a page is one vLLM block, {BLOCK} tokens here "
        "(--block-size)"]


def test_saves_to_a_store_no_supervisor_of_the_instance_serves_are_skipped_not_counted(
        supervisor: Path, instance: str, tmp_path: Path) -> None:
    """The connector's store_dir is not the one the instance's supervisor serves: its
    finished requests are counted as saves skipped for the mismatch, not as saves (the
    worker side, attached to nothing, could store none), their blocks go back at once,
    and lookups are skipped the same way."""
    prompt = list(range(3000, 3000 + 4 * BLOCK + 3))
    with rig(tmp_path / "elsewhere", instance) as r:
        r.sched.add_request(request("A", prompt, max_tokens=2))
        r.run_until_idle()
        side = r.sched.get_kv_connector()._scheduler
        totals = side.totals()
        assert totals["skipped:save_store_mismatch"] == 1, totals
        assert totals["skipped:lookup_store_mismatch"] == 1, totals
        assert not totals["saves"] and "A" not in r.finished_sending, totals
        client = r.workers[0]._worker.client
        assert client._connection() is None and client._absent == "store_mismatch"


@pytest.mark.parametrize("name", ["pipeline_parallel_size", "data_parallel_size_local",
                                  "decode_context_parallel_size",
                                  "prefill_context_parallel_size"])
def test_parallelism_that_would_share_a_ranks_registration_is_refused(
        tmp_path: Path, name: str) -> None:
    """A second pipeline stage (or data-parallel engine on the node, or context-parallel
    rank) would register tensor-parallel rank r again, overwriting the first's with
    nothing logged: the settings are refused, naming the setting and what is supported,
    and the connector is disabled (vLLM serves on). vLLM's own ParallelConfig has each
    field, at 1 by default, and passes."""
    from types import SimpleNamespace

    from sparkcache.vllm import settings

    def config(**parallel: int) -> SimpleNamespace:
        return SimpleNamespace(
            kv_transfer_config=SimpleNamespace(
                kv_connector_extra_config={"store_dir": str(tmp_path)}),
            cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="bfloat16"),
            model_config=SimpleNamespace(model="m", revision=None),
            parallel_config=SimpleNamespace(tensor_parallel_size=2, **parallel))

    vllm_config = pytest.importorskip("vllm.config")
    real = vllm_config.ParallelConfig()
    if not hasattr(real, name):
        pytest.skip(f"this vLLM has no {name}")
    assert settings.from_vllm(config(**{name: getattr(real, name)})).tp_size == 2
    with pytest.raises(ValueError, match=rf"\({name}=2\) is not supported.*{name}=1"):
        settings.from_vllm(config(**{name: 2}))



def test_a_draft_model_that_drops_vllms_last_block_drops_the_hits_last_page(
        tmp_path: Path) -> None:
    """EAGLE and MTP draft layers' KV at a block's last token was computed with the next
    token: vLLM's prefix cache drops a hit's last block for it (its
    ``use_eagle_block_drop``), unless its block hashes cover that token
    (``num_hash_lookahead_tokens``); the connector's settings follow the same rule."""
    from types import SimpleNamespace

    from sparkcache.vllm import settings

    spec_config = pytest.importorskip("vllm.config").SpeculativeConfig
    method = "use_eagle_block_drop" if hasattr(spec_config, "use_eagle_block_drop") \
        else "use_eagle"

    def config(drop: bool | None, lookahead: int = 0) -> SimpleNamespace:
        spec = None if drop is None else SimpleNamespace(**{method: lambda: drop})
        return SimpleNamespace(
            kv_transfer_config=SimpleNamespace(
                kv_connector_extra_config={"store_dir": str(tmp_path)}),
            cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="bfloat16"),
            model_config=SimpleNamespace(model="m", revision=None),
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
            speculative_config=spec, num_hash_lookahead_tokens=lookahead)

    assert settings.from_vllm(config(True)).drop_last_page
    assert not settings.from_vllm(config(False)).drop_last_page  # n-gram, say
    assert not settings.from_vllm(config(None)).drop_last_page  # no draft model
    assert not settings.from_vllm(config(True, lookahead=1)).drop_last_page
