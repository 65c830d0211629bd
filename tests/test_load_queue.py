"""Loads with a real supervisor and restore worker: the restore worker serves loads in
turn, so a one-page load asked for after a large one ends first."""

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

from sparkcache import config
from sparkcache.store import PageStore
from sparkcache.store.testing import make_root
from workers import restore as restore_mod

pytestmark = pytest.mark.slow

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
