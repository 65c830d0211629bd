"""Publications larger than a capture slot, through a real supervisor and its workers:
captured in parts, a slot each, stored whole, and never visible in part. A kill of
capture, commit or the supervisor in the middle leaves no root; the next attempt stores
it without writing the staged pages again."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from pipeline_util import (
    SyntheticEngine,
    check_restores,
    check_stopped,
    make_cfg,
    pipeline,
    runtime,
    start_supervisor,
    stop_supervisor,
    wait_committed,
    wait_for,
)
from sparkcache.workers import slotfmt
from sparkcache.workers.lifecycle import KILL_AT_ENV, KILL_FILE_ENV

pytestmark = pytest.mark.slow

# Pages of the synthetic engine are 16 KiB: a 64 KiB slot holds 3 of a part, and fewer
# beside the last part's entries, so a publication of 200 pages goes in 70 parts or so.
SLOTS = {"capture_slots": "2", "capture_slot_bytes": "64KiB", "release_timeout_seconds": "2"}
PAGES = 200
# Both kills come at the first part, so fewer pages do: capture's kill leaves the blocks
# lent until their deadline, 2 s per arena (128 KiB) of the publication's bytes.
KILLED_PAGES = 40


def _tokens(pages: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 50000, pages * 16 + 5).tolist()  # and a tail page


def _rows(store: Path, keys: tuple[str, ...]) -> dict[str, tuple[str, int]]:
    """Each stored key's (generation, refcount), read from the index."""
    conn = sqlite3.connect(f"file:{store / 'rank-0' / 'index.sqlite'}?mode=ro", uri=True)
    try:
        marks = ",".join("?" * len(keys))
        return {k: (g, r) for k, g, r in conn.execute(
            f"SELECT key, generation, refcount FROM objects WHERE key IN ({marks})", keys)}
    finally:
        conn.close()


def _publish_until_acknowledged(engine: SyntheticEngine, sid: str, tokens: list[int],
                                timeout: float = 60) -> None:
    assert engine.publish(sid, tokens), engine.client.counters
    wait_for(lambda: engine.poll() is not None and sid in engine.acknowledged, timeout,
             f"{sid} acknowledged: {engine.client.counters}")


def test_a_publication_many_slots_long_is_stored_whole(tmp_path: Path, instance: str) -> None:
    store = tmp_path / "store"
    with pipeline(store, instance, SLOTS) as engine:
        tokens = _tokens(PAGES, seed=1)
        keys = engine.keys(tokens)
        runs = engine.client._reg.views.run_bytes
        parts = slotfmt.plan_parts(len(keys), list(range(len(keys))), 64 << 10, runs)
        assert len(parts) > 30  # the case at hand: many slots long
        _publish_until_acknowledged(engine, "long", tokens)
        assert engine.client.lookup(tokens) == len(tokens)
        check_restores(engine, {"long": tokens})
        # The next turn adds pages past one slot again: only they are copied.
        turn2 = tokens + _tokens(20, seed=2)
        _publish_until_acknowledged(engine, "long", turn2)
        assert wait_committed(engine, timeout=30, settle=1.0, seqs={"long": turn2}) == {}
        check_restores(engine, {"long": turn2})
        assert all(r == 1 for _, r in _rows(store, engine.keys(turn2)).values())


@pytest.mark.parametrize("step", ["capture.filled", "commit.committed"])
def test_a_worker_killed_mid_publication_leaves_no_root_and_the_retry_stores_it(
        tmp_path: Path, instance: str, step: str) -> None:
    """Both steps first come at the publication's first part: capture dies with it handed
    over (commit stages it, the rest is never captured); commit dies with it staged (its
    successor takes the parts that follow, and the last publishes the root)."""
    store = tmp_path / "store"
    kill = tmp_path / "kill"
    kill.touch()
    with pipeline(store, instance, SLOTS, {KILL_AT_ENV: step, KILL_FILE_ENV: str(kill)}) \
            as engine:
        tokens = _tokens(KILLED_PAGES, seed=3)
        keys = engine.keys(tokens)
        assert engine.publish("long", tokens), engine.client.counters
        wait_for(lambda: not kill.exists(), 30, f"{step} reached")
        if step == "capture.filled":
            # Blocks come back by the deadline; commit stages what it was handed.
            engine.drain(timeout=60)
            assert "long" not in engine.acknowledged
            staged = wait_for(lambda: {k: v for k, v in _rows(store, keys).items()}, 10,
                              "the first part staged")
            assert all(r == 0 for _, r in staged.values())  # no root names them
            assert engine.client.lookup(tokens) == 0  # nothing visible
            time.sleep(1.0)  # the restarted capture is READY (publications wait for it)
            _publish_until_acknowledged(engine, "long", tokens)
            after = _rows(store, keys)
            # The staged pages were adopted, not written again.
            assert {k: after[k][0] for k in staged} == {k: g for k, (g, _) in staged.items()}
        else:
            wait_for(lambda: engine.poll() is not None and "long" in engine.acknowledged, 60,
                     f"acknowledged by commit's successor: {engine.client.counters}")
        assert engine.client.lookup(tokens) == len(tokens)
        check_restores(engine, {"long": tokens})


def test_a_supervisor_killed_mid_publication_leaves_no_root_and_the_retry_stores_it(
        tmp_path: Path, instance: str) -> None:
    store = tmp_path / "store"
    flags = [a for k, v in SLOTS.items() for a in (f"--{k.replace('_', '-')}", v)]
    sup = start_supervisor(store, instance, *flags)
    engine = SyntheticEngine.create(make_cfg(store, instance, **SLOTS), 0)
    try:
        tokens = _tokens(PAGES, seed=4)
        keys = engine.keys(tokens)
        assert engine.publish("long", tokens), engine.client.counters
        # Killed as soon as a part is durable, long before the last (70 or so syncs).
        staged = wait_for(lambda: _rows(store, keys), 30, "a part staged", poll=0.002)
        tree = [p.pid for p in psutil.Process(sup.pid).children(recursive=True)]
        sup.kill()
        sup.communicate(timeout=30)
        wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                 for p in tree), 20, "workers to die with the supervisor")
    finally:
        engine.close()
    rows = _rows(store, keys)
    assert len(rows) < len(keys) and all(r == 0 for _, r in rows.values()), \
        "the publication ended before the kill: no partial state to check"
    del staged
    sup = start_supervisor(store, instance, *flags)
    engine = None
    try:
        # The killed supervisor's runtime.json is still there: wait for this one's.
        wait_for(lambda: (rt := runtime(store))["pid"] == sup.pid and all(
            w["state"] == "RUNNING" for w in rt["workers"]), 60, "the new supervisor")
        engine = SyntheticEngine.create(make_cfg(store, instance, **SLOTS), 0)
        assert engine.client.lookup(tokens) == 0
        _publish_until_acknowledged(engine, "long", tokens)
        assert engine.client.lookup(tokens) == len(tokens)
        check_restores(engine, {"long": tokens})
        after = _rows(store, keys)
        assert {k: after[k][0] for k in rows} == {k: g for k, (g, _) in rows.items()}
    finally:
        if engine is not None:
            engine.close()
        stopped = stop_supervisor(sup)
    check_stopped(stopped, store, instance)
