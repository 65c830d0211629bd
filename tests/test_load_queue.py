"""Loads never fail for room, with a real supervisor and restore worker: more loads at once
than the load ring and the client's limit of loads in flight hold (and one larger than
the ring) wait in the client's queue, and every one loads byte-exact; the restore worker
serves loads in turn, so a one-page load asked for after a large one ends first; a load
sent in parts ends at a corrupt page of a later part."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from pipeline_util import (
    LAYERS,
    SyntheticEngine,
    check_stopped,
    kv_shape,
    make_cfg,
    runtime,
    start_supervisor,
    stop_supervisor,
    wait_for,
)
from sparkcache.workers import restore as restore_mod

from sparkcache import client as client_mod
from sparkcache import config, segments
from sparkcache.store import PageStore
from sparkcache.store.objects import HEADER_SIZE
from sparkcache.store.reader import StoreReader
from sparkcache.store.testing import make_root, object_file

pytestmark = pytest.mark.slow

RING_PAGES = segments.RINGS["load"][1]
ROOT_PAGES = 1024  # pages committed as one root (a pack) when the store is filled


@contextlib.contextmanager
def stored_prefix(store: Path, instance: str, pages: int, blocks: int,
                  **settings: str) -> Iterator[tuple[SyntheticEngine, list[int]]]:
    """An engine of ``blocks`` KV blocks, a store holding the ``pages`` pages of one token
    sequence (committed before the supervisor starts), and a supervisor whose restore
    worker is running. Yields the engine and the sequence's tokens."""
    cfg = make_cfg(store, instance, **settings)
    engine = SyntheticEngine.create(cfg, 0, blocks=blocks)
    sup = None
    try:
        rng = np.random.default_rng(pages)
        tokens = rng.integers(0, 50_000, pages * cfg.page_tokens).tolist()
        keys = list(engine.keys(tokens))
        page = engine.client._reg.views.page_bytes
        with PageStore(store, 0) as ps:
            for i in range(0, pages, ROOT_PAGES):
                ps.commit(make_root(os.urandom(16).hex(), keys[i : i + ROOT_PAGES], page))
        flags = [a for k, v in settings.items() for a in (config.flag_name(k), v)]
        sup = start_supervisor(store, instance, *flags)
        wait_for(lambda: next(w for w in runtime(store)["workers"]
                              if w["role"] == "restore")["state"] == "RUNNING",
                 60, "the restore worker to run")
        yield engine, tokens
    finally:
        engine.close()
        if sup is not None:
            check_stopped(stop_supervisor(sup), store, instance)


def test_loads_beyond_the_ring_and_the_load_limit_all_load(tmp_path: Path,
                                                           instance: str) -> None:
    """At once: one load larger than the ring, loads that together are larger than it,
    and more one-page loads than MAX_LOADS. None is refused or fails; every page lands
    byte-exact; the waits are counted and published with the engine's counters."""
    big = RING_PAGES + client_mod.PART_PAGES // 2  # sent in parts
    mid, mids = RING_PAGES // 4 + 1, 5  # five of them are more than the ring holds
    ones = client_mod.MAX_LOADS + 40
    blocks = big + mid * mids + ones
    store = tmp_path / "store"
    # One-token pages (1 KiB): the figures above take 66 MiB of KV and of store.
    with stored_prefix(store, instance, big, blocks, page_tokens="1",
                       max_bytes="1GiB") as (engine, tokens):
        c = engine.client
        free = list(range(blocks))
        plans: dict[str, tuple[list[int], list[int]]] = {"big": (tokens, free[:big])}
        at = big
        for i in range(mids):
            plans[f"mid{i}"] = (tokens[:mid], free[at : at + mid])
            at += mid
        for i in range(ones):
            plans[f"one{i}"] = (tokens[:1], free[at : at + 1])
            at += 1
        for lid, (toks, blks) in plans.items():
            assert engine._timed(c.load, lid, toks, blks), (lid, c.counters.misses)
        assert c.loads_waiting > 0 and c.loads_in_flight == len(plans)
        results = engine.wait_loaded(list(plans), timeout=600)
        for lid, (toks, blks) in plans.items():
            r = results[lid]
            assert (r.status, r.tokens, r.bad_page) == ("ok", len(toks), None), (lid, r)
            assert all(engine.exact_pages(toks, blks)), lid
        assert not c.counters.misses, c.counters.misses  # nothing refused, nothing failed
        assert c.counters.load_status == {"ok": len(plans)}
        assert c.loads_in_flight == 0 and c.loads_waiting == 0
        assert c.counters.loads_queued > 0 and c.counters.load_queue_seconds > 0
        assert c.counters.loaded_pages == sum(len(b) for _, b in plans.values())
        # The waits and the (now empty) queue reach the engine stats block the
        # supervisor serves.
        with segments.attach_engine_stats(c.cfg, 0) as block:
            def published():
                engine.poll()
                rec = block.read(0)
                return rec if rec is not None and \
                    rec.loads_queued == c.counters.loads_queued else None
            rec = wait_for(published, 10, "the queue's counters to be published")
        assert rec.load_queue_depth == 0 and rec.load_queue_seconds > 0
        assert rec.load_ok == len(plans)


def test_a_one_page_load_ends_before_a_large_one_asked_first(tmp_path: Path,
                                                             instance: str) -> None:
    """The restore worker serves loads chunk by chunk in turn: a one-page load asked for
    just after a load of many chunks is answered before it."""
    store = tmp_path / "store"
    page = make_cfg(store, instance).page_tokens
    page_bytes = LAYERS * int(np.prod(kv_shape(page, 1))) * 2  # float16
    # Twice the chunks the worker reads ahead: 128 MiB of 16 KiB pages.
    chunks = 2 * restore_mod.STAGED_CHUNKS
    large = chunks * max(1, restore_mod.CHUNK_BYTES // page_bytes)
    with stored_prefix(store, instance, large, large + 1) as (engine, tokens):
        assert engine.client._reg.views.page_bytes == page_bytes
        c = engine.client
        assert c.load("large", tokens, list(range(large)))
        assert c.load("one", tokens[:page], [large])
        order = []
        while len(order) < 2:
            order += [r.load_id for r in c.poll_loads()
                      if r.status == "ok" or pytest.fail(f"{r}")]
        assert order == ["one", "large"], order
        assert all(engine.exact_pages(tokens, list(range(large))))
        assert all(engine.exact_pages(tokens[:page], [large]))


def test_a_load_in_parts_ends_at_a_corrupt_page_of_a_later_part(tmp_path: Path,
                                                                 instance: str) -> None:
    """A load larger than PART_PAGES goes in parts; a page that fails verification in a
    later part ends the load there: reported with its index in the whole load, the pages
    before it loaded, the page quarantined."""
    pages = client_mod.PART_PAGES + 8
    bad = client_mod.PART_PAGES + 3
    store = tmp_path / "store"
    with stored_prefix(store, instance, pages, pages, page_tokens="1",
                       max_bytes="1GiB") as (engine, tokens):
        keys = engine.keys(tokens)
        reader = StoreReader(store, 0)
        try:
            path, offset = object_file(reader.layout.objects_dir, reader.conn, keys[bad])
        finally:
            reader.close()
        raw = bytearray(path.read_bytes())
        raw[offset + HEADER_SIZE + 5] ^= 0xFF  # the header parses, the checksum fails
        path.write_bytes(bytes(raw))
        assert engine.client.load("parts", tokens, list(range(pages)))
        r = engine.wait_loaded(["parts"], timeout=300)["parts"]
        assert (r.status, r.bad_page, r.tokens) == ("corrupt", bad, bad), r
        assert all(engine.exact_pages(tokens[:bad], list(range(bad))))
        assert engine.client.counters.loaded_pages == bad
        quarantine = store / "rank-0" / "quarantine"
        wait_for(lambda: any(p.name.startswith(keys[bad]) for p in quarantine.iterdir()),
                 30, "the corrupt page to be quarantined")
