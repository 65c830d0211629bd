"""End to end through the supervisor: a synthetic engine publishes 200 sequences with
shared and distinct prefixes; every published page restores byte-exact; shared pages are
stored once; and SIGKILLed workers are restarted without losing an acknowledged root."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from pipeline_util import (
    BLOCKS,
    SyntheticEngine,
    check_restores,
    check_stopped,
    make_cfg,
    pipeline,
    runtime,
    sequences,
    start_supervisor,
    stop_supervisor,
    wait_committed,
)
from sparkcache.shm.layouts import PUBLISH, REQUEST
from sparkcache.workers.lifecycle import Role

from sparkcache import config, kvmem, segments
from sparkcache.store import PageStore

pytestmark = pytest.mark.slow


def _wait_touched(store: Path, roots: int, timeout: float = 10) -> None:
    """Restores' accesses reach the index as touch requests to the maintenance worker."""
    deadline = time.monotonic() + timeout
    while True:
        conn = sqlite3.connect(store / "rank-0" / "index.sqlite")
        try:
            n = conn.execute("SELECT count(*) FROM roots WHERE last_access > created").fetchone()[0]
        finally:
            conn.close()
        if n >= roots or time.monotonic() > deadline:
            assert n >= roots, f"{n} of {roots} roots touched"
            return
        time.sleep(0.1)


def test_publish_200_sequences_restore_byte_exact(tmp_path: Path, instance: str) -> None:
    store = tmp_path / "store"
    with pipeline(store, instance) as engine:
        seqs = sequences(200)
        for sid, tokens in seqs.items():
            assert engine.publish(sid, tokens), (sid, engine.client.counters)
        engine.drain()
        assert engine.client.pending == 0
        assert engine.client.counters.completed == 200, engine.client.counters
        assert wait_committed(engine, settle=10) == {}
        assert check_restores(engine, seqs) == sum(len(engine.keys(t)) for t in seqs.values())
        unique = {k for t in seqs.values() for k in engine.keys(t)}
        total = sum(len(engine.keys(t)) for t in seqs.values())
        assert len(unique) < total  # the workload does share prefixes
        with PageStore(store, 0) as ps:
            usage = ps.usage()
        assert usage.objects == len(unique)  # each shared page stored once
        assert usage.entries == 200
        assert engine.max_call_s < 0.25, engine.max_call_s
        _wait_touched(store, 200)
        # Capture bounds-checks block ids against the registered geometry.
        assert engine.client.publish("bad", list(range(40)), [0, 1, BLOCKS + 5])
        deadline = time.monotonic() + 10
        done = []
        while not done and time.monotonic() < deadline:
            done = engine.poll()
            time.sleep(0.01)
        assert [(c.seq_id, c.status) for c in done] == [("bad", "bad_block")]
        assert engine.client.counters.capture_failed["bad_block"] == 1


def _running_pid(store: Path, role: str, not_these: list[int], timeout: float = 20) -> int:
    """The pid of ``role``'s current process once it is a new one (restarted)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        w = next(w for w in runtime(store)["workers"] if w["role"] == role)
        if w["pid"] and w["pid"] not in not_these:
            return w["pid"]
        time.sleep(0.05)
    pytest.fail(f"{role} was not restarted within {timeout}s")


@pytest.mark.parametrize("role", ["capture", "commit", "maintenance"])
def test_worker_sigkilled_during_publication(tmp_path: Path, instance: str, role: str) -> None:
    store = tmp_path / "store"
    rng = random.Random(role)
    with pipeline(store, instance, {"release_timeout_seconds": "2"}) as engine:
        seqs = sequences(60, seed=1)
        kill_at = sorted(rng.sample(range(5, 55), 3))
        killed = []
        restored_while_down = 0
        for i, (sid, tokens) in enumerate(seqs.items()):
            if kill_at and i == kill_at[0]:
                kill_at.pop(0)
                pid = _running_pid(store, role, killed)
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                # Restores keep working while the worker is down.
                stored = [t for t in engine.accepted.values() if engine.client.lookup(t) == len(t)]
                n = len(engine.keys(stored[0])) if stored else 0
                if stored and len(engine.free) >= n:
                    # Into free blocks only: pending ones are still being captured.
                    blocks = engine.free[-n:]
                    assert engine.client.restore(stored[0], blocks) == len(stored[0])
                    restored_while_down += 1
            engine.publish(sid, tokens, tries=50)
        engine.drain()
        counters = engine.client.counters
        assert engine.client.pending == 0
        assert len(killed) == 3
        assert restored_while_down >= 2
        assert engine.acknowledged, counters
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            w = next(w for w in runtime(store)["workers"] if w["role"] == role)
            if w["restarts"] >= 3 and w["state"] == "RUNNING":
                break
            time.sleep(0.1)
        assert w["restarts"] >= 3 and w["state"] == "RUNNING", w
        missing = wait_committed(engine)
        # Acknowledged (capture said "captured") publications all reach the store;
        # others (expired while a worker was down, refused) may be missing.
        lost = set(missing) & engine.acknowledged
        assert not lost, (lost, counters)
        check_restores(engine, {s: engine.accepted[s] for s in engine.acknowledged})
        skipped = sum(counters.skipped.values())
        assert counters.published + skipped >= len(seqs)  # every call accounted for
        assert engine.max_call_s < 0.25, engine.max_call_s


def test_fresh_tensors_helper_is_shared_memory(instance: str) -> None:
    kv = kvmem.SharedKVCaches.create(instance, 0, [(2, 4, 16, 1, 8)], torch.float16)
    try:
        desc = kvmem.describe(kv.tensors)
        opened = kvmem.open_tensors(desc)
        opened.tensors[0][1, 2].fill_(3.0)
        assert float(kv.tensors[0][1, 2].sum()) == 3.0 * 16 * 8
        opened.close()
    finally:
        kv.close()


def _nasty_publications(rng: np.random.Generator, reg_gen: int) -> list[np.ndarray]:
    """Publish batches no well-behaved client sends: random bytes, and well-framed
    batches with one field wrong each (NaN or far-future deadline, npages that lie,
    page_index out of order, mixed pub ids, block ids out of range)."""
    out = [np.frombuffer(rng.bytes(PUBLISH.itemsize * n), PUBLISH.dtype).copy()
           for n in (1, 3, 17, 64)]
    for flaw in range(6):
        recs = np.zeros(4, PUBLISH.dtype)
        recs["pub_id"], recs["npages"], recs["page_index"] = 99, 4, np.arange(4)
        recs["reg_gen"] = reg_gen
        recs["deadline"] = time.monotonic() + 2
        if flaw == 0:
            recs["deadline"] = float("nan")
        elif flaw == 1:
            recs["deadline"] = 1e300
        elif flaw == 2:
            recs["npages"] = 3
        elif flaw == 3:
            recs["page_index"] = [0, 2, 1, 3]
        elif flaw == 4:
            recs["pub_id"][2] = 98
        else:
            recs["block_id"] = 10**9
        out.append(recs)
    return out


def test_a_running_instance_survives_malformed_records(tmp_path: Path, instance: str) -> None:
    """Malformed publications and requests pushed into a running instance: no worker
    exits, nothing is stored from them, each is counted, and well-formed publications
    made afterwards are durable and restore byte-exact."""
    store = tmp_path / "store"
    rng = np.random.default_rng(21)
    with pipeline(store, instance) as engine:
        cfg = engine.client.cfg
        engine.client._disconnect()  # its rings' producer end, attached as it registered
        publish = segments.producer(cfg, 0, "publish")
        request = segments.producer(cfg, 0, "request")
        try:
            for batch in _nasty_publications(rng, engine.client._reg.reg_gen):
                publish.push_batch(batch)
            for n in (1, 5, 40):
                request.push_batch(
                    np.frombuffer(rng.bytes(REQUEST.itemsize * n), REQUEST.dtype).copy())
        finally:
            publish.detach()  # the engine's client attaches as the next producer
            request.detach()
        seqs = sequences(20, cfg.page_tokens, seed=8)
        for sid, tokens in seqs.items():
            assert engine.publish(sid, tokens)
        engine.drain()
        assert engine.acknowledged == set(seqs), engine.client.counters
        check_restores(engine, seqs)
        with PageStore(store, 0, create=False) as ps:
            assert ps.usage().entries == len(seqs)  # nothing stored from the bad batches
        with segments.attach_stats(cfg, 0) as stats:
            capture = stats.read(int(Role.CAPTURE))
            deadline = time.monotonic() + 10  # maintenance takes requests between passes
            while stats.read(int(Role.MAINTENANCE)).drop_request == 0:
                assert time.monotonic() < deadline, "maintenance never counted the requests"
                time.sleep(0.05)
        assert capture.drop_framing and capture.drop_deadline and capture.drop_mixed
        assert capture.drop_page_index and capture.drop_block
        assert [w["name"] for w in runtime(store)["workers"] if w["restarts"]] == []


def test_turns_sent_as_new_requests_keep_one_root(tmp_path: Path, instance: str) -> None:
    """vLLM sends every turn of a conversation as a new request re-sending the prefix:
    each commit supersedes the root of the turn before, and commit counts it."""
    store = tmp_path / "store"
    with pipeline(store, instance) as engine:
        page = engine.client.cfg.page_tokens
        tokens, turns = [], {}
        for turn in range(4):
            tokens = tokens + list(range(1000 * turn, 1000 * turn + 2 * page))
            turns[f"request-{turn}"] = tokens
            assert engine.publish(f"request-{turn}", tokens)
            engine.drain()  # the next turn comes once this one is answered
        assert engine.acknowledged == set(turns), engine.client.counters
        check_restores(engine, {"request-3": tokens})
        with PageStore(store, 0, create=False) as ps:
            assert ps.usage().entries == 1
            assert ps.usage().objects == len(engine.keys(tokens))
        with segments.attach_stats(engine.client.cfg, 0) as stats:
            deadline = time.monotonic() + 5  # commit writes its stats at its next beat
            while stats.read(int(Role.COMMIT)).roots_superseded < 3:
                assert time.monotonic() < deadline, stats.read(int(Role.COMMIT))
                time.sleep(0.05)
            assert stats.read(int(Role.COMMIT)).roots_superseded == 3


def test_a_stop_commits_everything_captured(tmp_path: Path, instance: str) -> None:
    """SIGTERM right after a burst of publications, with commit behind: the supervisor
    stops capture first and lets commit drain, so every publication capture copied is
    reported durable (the client still holds the unlinked rings' mappings) and is in the
    store afterwards."""
    store = tmp_path / "store"
    settings = {"capture_slots": "8"}
    flags = [a for k, v in settings.items() for a in (config.flag_name(k), v)]
    sup = start_supervisor(store, instance, *flags)
    engine = SyntheticEngine.create(make_cfg(store, instance, **settings))
    try:
        seqs = sequences(60, engine.client.cfg.page_tokens, seed=13)
        for sid, tokens in seqs.items():
            engine.publish(sid, tokens)
            engine.poll()
        behind = engine.client.awaiting_durable
        stopped = stop_supervisor(sup)
        engine.drain(timeout=5)
        assert engine.captured, engine.client.counters
        assert engine.acknowledged == engine.captured, (behind, engine.client.counters)
        with PageStore(store, 0, create=False) as ps:
            assert all(ps.lookup(engine.keys(seqs[s])) == len(engine.keys(seqs[s]))
                       for s in engine.acknowledged)
    finally:
        engine.close()
        if sup.poll() is None:
            stop_supervisor(sup)
    check_stopped(stopped, store, instance)
