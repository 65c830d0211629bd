"""What a worker does with what it should never get: malformed records in every ring, a
slot whose writer is alive but whose record never came, an item whose handling raises.
The workers run in the test's process on real segments and a real store (worker_rig), so
every step is deterministic."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pipeline_util import check_restores, sequences
from sparkcache.shm import FREE, RingFull, SlotArena
from sparkcache.shm.layouts import DROP_REASONS, LOAD
from worker_rig import Rig, rig

from sparkcache import kvmem, segments
from sparkcache.segments import OWNER_CAPTURE, OWNER_COMMIT
from sparkcache.store.reader import StoreReader

SETTINGS = {"release_timeout_seconds": "5"}


def _hand_over_unannounced(cfg, slot: int) -> None:
    """What capture does up to the hand-over, without the ``filled`` record: on arm64 a
    reader can see such a slot's owner before its bytes."""
    arena = segments.attach_arena(cfg, 0)
    try:
        arena.hand_over(slot, FREE, OWNER_CAPTURE)
        arena.slot_array(slot)[:4096] = 7  # not a publication: reading it would be a bug
        arena.hand_over(slot, OWNER_CAPTURE, OWNER_COMMIT, 4096)
    finally:
        arena.close()


def test_commit_reads_a_slot_only_under_a_record_or_after_its_writer_died(
        tmp_path: Path, instance: str) -> None:
    with rig(tmp_path / "store", instance, **SETTINGS) as r:
        arena: SlotArena = r.commit.arena
        _hand_over_unannounced(r.cfg, 0)  # by this process, which lives on
        deadline = time.monotonic() + 2.5  # the old orphan path took it after 1 s
        while time.monotonic() < deadline:
            r.commit._step(0.05)
        assert int(arena.state[0]["owner"]) == OWNER_COMMIT
        assert r.commit.life.failed == 0

        child = mp.get_context("spawn").Process(target=_hand_over_unannounced,
                                                args=(r.cfg, 1))
        child.start()
        child.join(30)
        assert child.exitcode == 0
        r.commit._step(0)  # its writer is dead: its writes are complete, commit takes it
        assert int(arena.state[1]["owner"]) == FREE
        assert r.commit.life.failed == 1  # it held no publication: refused, not stored
        assert int(arena.state[0]["owner"]) == OWNER_COMMIT  # still not read
        arena.hand_over(0, OWNER_COMMIT, FREE)  # tidy for the rig's close


def _record_bytes(layout_itemsize: int) -> st.SearchStrategy[bytes]:
    return st.integers(1, 6).flatmap(
        lambda n: st.binary(min_size=n * layout_itemsize, max_size=n * layout_itemsize))


def _ring_ends(r: Rig) -> dict:
    """Ring name -> (the producer end this process can push through, its layout)."""
    conn = r.engine.client._connection()
    assert conn is not None
    return {
        "publish": conn.publish, "request": conn.request, "load": conn.load,
        "completion": r.capture.completion, "filled": r.capture.filled,
        "freed": r.commit.freed, "durable": r.commit.durable, "loaded": r.restore.loaded,
        "lease": r.lease,
    }


def test_malformed_records_in_every_ring_are_dropped_and_counted(
        tmp_path: Path, instance: str) -> None:
    with rig(tmp_path / "store", instance, **SETTINGS) as r:
        ends = _ring_ends(r)
        assert set(ends) == set(segments.RINGS)  # every ring
        layouts = {name: segments.RINGS[name][0] for name in ends}

        @settings(max_examples=60, deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture,
                                         HealthCheck.too_slow])
        @given(st.lists(st.sampled_from(sorted(ends)).flatmap(
            lambda name: st.tuples(st.just(name), _record_bytes(layouts[name].itemsize))),
            min_size=1, max_size=6))
        def garbage_never_hurts(pushes: list[tuple[str, bytes]]) -> None:
            for name, raw in pushes:
                with contextlib.suppress(RingFull):  # a full ring is a state like another
                    ends[name].push_batch(np.frombuffer(raw, layouts[name].dtype).copy())
            r.step()  # raises if any worker or the client would have crashed

        garbage_never_hurts()
        assert r.commit.store.usage().entries == 0  # nothing stored from garbage
        workers = (r.capture, r.commit, r.maintenance, r.restore)
        drops = {reason: sum(w.life.drops[reason] for w in workers) for reason in DROP_REASONS}
        assert drops["framing"] and drops["request"], drops
        assert r.restore.life.drops["framing"], r.restore.life.drops
        assert r.restore.life.item_errors == 0 and r.restore.life.copy_bytes == 0
        assert r.engine.client.counters.ring_errors == 0
        assert r.engine.loaded == {}  # no report of garbage reached the engine as a load

        # Well-formed publications made afterwards are durable and restore byte-exact.
        seqs = sequences(10, r.cfg.page_tokens, seed=11)
        for sid, tokens in seqs.items():
            assert r.engine.publish(sid, tokens, tries=1), r.engine.client.counters
            r.step(2)
        r.step(3)
        assert set(seqs) <= r.engine.acknowledged, r.engine.client.counters
        check_restores(r.engine, seqs)

        # Well-formed loads afterwards load byte-exact; one addressed to another restore
        # worker (a dead predecessor) is dropped as stale and answered so.
        blocks = {sid: [r.engine.free[i] for i in range(j * 8, j * 8 + 8)]
                  for j, sid in enumerate(seqs)}
        for sid, tokens in seqs.items():
            assert r.engine.client.load(sid, tokens, blocks[sid]), r.engine.client.counters
        r.step(2)
        for sid, tokens in seqs.items():
            assert r.engine.loaded[sid].status == "ok", r.engine.loaded[sid]
            assert all(r.engine.exact_pages(tokens, blocks[sid]))
        stale = np.zeros(1, LOAD.dtype)
        stale["npages"], stale["worker_pid"], stale["load_id"] = 1, 1, 7
        ends["load"].push_batch(stale)
        before = r.restore.life.drops["stale"]
        r.step()
        assert r.restore.life.drops["stale"] == before + 1


def test_a_failing_item_is_counted_and_the_worker_goes_on(
        tmp_path: Path, instance: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with rig(tmp_path / "store", instance, **SETTINGS) as r:
        seqs = sequences(3, r.cfg.page_tokens, seed=2)
        (s1, t1), (s2, t2), (s3, t3) = seqs.items()
        real_commit = r.commit.store.commit_batch
        calls = []

        def commit_once_broken(publications, more=None):
            calls.append(publications)
            if len(calls) == 1:
                raise RuntimeError("injected fault in one commit")
            return real_commit(publications, more)

        monkeypatch.setattr(r.commit.store, "commit_batch", commit_once_broken)
        assert r.engine.publish(s1, t1, tries=1)
        r.step(3)
        assert r.engine.publish(s2, t2, tries=1)
        r.step(3)
        durable = r.engine.client.counters
        assert s1 in r.engine.captured and s1 not in r.engine.acknowledged
        assert durable.not_durable["commit_failed"] == 1
        assert s2 in r.engine.acknowledged
        assert r.commit.life.item_errors == 1 and r.commit.life.failed == 1

        # A registration capture cannot open fails that publication, not capture.
        path = kvmem.registry_path(r.cfg.store_dir, 0)
        good = json.loads(path.read_text())
        bad = {**good, "tensors": [{**good["tensors"][0], "segment": "/sparkcache.nope.r0.kv"}]}
        path.write_text(json.dumps(bad))
        r.capture.reg.opened.close()
        r.capture.reg = None
        assert r.engine.publish(s3, t3, tries=1)
        r.step(3)
        assert r.engine.client.counters.capture_failed["unregistered"] == 1
        assert r.capture.life.item_errors == 1
        path.write_text(json.dumps(good))
        assert r.engine.publish(s3, t3, tries=1)
        r.step(3)
        assert s3 in r.engine.acknowledged
        check_restores(r.engine, {s2: t2, s3: t3})

        # A load whose handling raises fails alone (answered, nothing after it lost).
        real_plan = StoreReader.plan
        planned = []

        def plan_once_broken(reader, keys):
            planned.append(keys)
            if len(planned) == 1:
                raise RuntimeError("injected fault in one load")
            return real_plan(reader, keys)

        monkeypatch.setattr(StoreReader, "plan", plan_once_broken)
        assert r.engine.client.load("broken", t2, r.engine.free[:8])
        assert r.engine.client.load("fine", t2, r.engine.free[8:16])
        r.step()
        assert r.engine.loaded["broken"].status == "failed"
        assert r.engine.loaded["fine"].status == "ok"
        assert all(r.engine.exact_pages(t2, r.engine.free[8:16]))
        assert r.restore.life.item_errors == 1 and r.restore.life.failed == 1


def test_a_batch_that_fails_is_committed_one_by_one_each_with_its_outcome(
        tmp_path: Path, instance: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Publications handed over together are committed as one batch; if it fails, each
    is committed alone: the one at fault fails, the others are acknowledged."""
    with rig(tmp_path / "store", instance, **SETTINGS) as r:
        (s1, t1), (s2, t2), (s3, t3) = sequences(3, r.cfg.page_tokens, seed=9).items()
        real_commit = r.commit.store.commit_batch
        batches: list[int] = []
        bad_root: list[str] = []

        def fails_with_the_first(publications, more=None):
            publications = list(publications)
            if not bad_root:
                bad_root.append(publications[0].root.root_id)
            if more is not None:  # the worker's batch: every slot readable meanwhile joins
                publications += list(more())
            batches.append(len(publications))
            if any(p.root.root_id == bad_root[0] for p in publications):
                raise RuntimeError("injected fault in one publication")
            return real_commit(publications)

        monkeypatch.setattr(r.commit.store, "commit_batch", fails_with_the_first)
        for seq, tokens in ((s1, t1), (s2, t2), (s3, t3)):
            assert r.engine.publish(seq, tokens, tries=1)
        r.capture._step(0)  # all three captured before commit looks
        r.capture._step(0)
        r.capture._step(0)
        r.step(3)
        assert batches[0] == 3 and batches[1:] == [1, 1, 1]
        counters = r.engine.client.counters
        assert counters.not_durable["commit_failed"] == 1
        assert s1 not in r.engine.acknowledged
        assert s2 in r.engine.acknowledged and s3 in r.engine.acknowledged
        assert r.commit.life.failed == 1
        check_restores(r.engine, {s2: t2, s3: t3})


def test_every_load_among_malformed_records_is_answered(
        tmp_path: Path, instance: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load whose first record lost its page index runs into the load before it: the
    two are one malformed group, and both are answered (an unanswered load holds its
    blocks until the worker dies)."""
    with rig(tmp_path / "store", instance, **SETTINGS) as r:
        answered: list[tuple[int, int]] = []
        real = type(r.restore)._answer

        def recorded(worker, load_id, outcome):
            answered.append((load_id, int(outcome.status)))
            return real(worker, load_id, outcome)

        monkeypatch.setattr(type(r.restore), "_answer", recorded)
        recs = np.zeros(4, LOAD.dtype)
        recs["load_id"] = [101, 101, 102, 102]
        recs["npages"] = 2
        recs["page_index"] = [0, 1, 1, 1]  # 102's first record should be 0
        recs["worker_pid"], recs["worker_start"] = r.restore.me
        _ring_ends(r)["load"].push_batch(recs)
        r.step()
        from sparkcache.protocol import LoadStatus
        assert sorted(answered) == [(101, int(LoadStatus.MALFORMED)),
                                    (102, int(LoadStatus.MALFORMED))]


def test_a_stored_page_of_another_size_is_not_loaded(tmp_path: Path, instance: str) -> None:
    """Pages stored under the engine's keys but of another size than its pages end the
    load before them; the blocks keep what they held."""
    from sparkcache.store.testing import make_root

    with rig(tmp_path / "store", instance, **SETTINGS) as r:
        (sid, tokens), = sequences(1, r.cfg.page_tokens, seed=5).items()
        keys = r.engine.keys(tokens)
        page_bytes = r.engine.client._reg.views.page_bytes
        r.commit.store.commit(make_root("ab" * 16, keys, page_bytes // 2))
        blocks = r.engine.free[: len(keys)]
        before = [r.engine.client._reg.views.tensors[0].clone()]
        assert r.engine.client.load(sid, tokens, blocks)
        r.step(2)
        result = r.engine.loaded[sid]
        assert (result.status, result.tokens) == ("partial", 0), result
        assert r.engine.client._reg.views.tensors[0].equal(before[0])


def test_a_read_stuck_past_its_limit_stops_the_heartbeat(monkeypatch: pytest.MonkeyPatch) -> None:
    """The restore worker beats while a chunk is read, for STUCK_READ_S: a disk that hangs
    longer shows as a hung worker (the supervisor restarts it and its loads end) instead
    of one that beats on while every load waits."""
    import itertools
    import threading
    from concurrent.futures import Future
    from types import SimpleNamespace

    from sparkcache.workers import lifecycle
    from sparkcache.workers import restore as restore_mod

    ticks = itertools.count(0, 10.0)  # each look at the clock: 10 s later
    monkeypatch.setattr(restore_mod, "time", SimpleNamespace(monotonic=lambda: next(ticks)))
    monkeypatch.setattr(lifecycle, "PROGRESS_BEAT_S", 0.005)
    beats: list[int] = []
    worker = restore_mod.Restore.__new__(restore_mod.Restore)
    worker.life = SimpleNamespace(progress=lambda: beats.append(1))
    fut: Future = Future()
    threading.Timer(0.5, fut.set_result, ("read",)).start()  # about 100 beat periods
    assert worker._wait(fut) == "read"
    assert len(beats) == restore_mod.STUCK_READ_S // 10 - 1  # before the limit, none after


def test_a_fault_in_idle_read_ahead_does_not_stop_the_restore_worker(
        tmp_path: Path, instance: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading ahead while idle is work ahead of loads: its fault gives it up, logged,
    and the worker goes on serving loads."""
    import sqlite3

    with rig(tmp_path / "store", instance, **SETTINGS) as r:
        seqs = sequences(1, r.cfg.page_tokens, seed=3)
        (sid, tokens), = seqs.items()
        assert r.engine.publish(sid, tokens, tries=1)
        r.step(3)

        def broken(reader, budget):
            raise sqlite3.OperationalError("disk I/O error")

        monkeypatch.setattr(StoreReader, "recent_pages", broken)
        r.restore._ahead = None  # plan the read-ahead again, now
        r.step()  # idle: raised out of the worker before
        assert r.restore._ahead is not None and not r.restore._ahead
        check_restores(r.engine, seqs)
        blocks = r.engine.free[:8]
        assert r.engine.client.load(sid, tokens, blocks)
        r.step(2)
        assert r.engine.loaded[sid].status == "ok"


def test_a_durability_report_that_overtakes_its_completion_is_not_awaited_again(
        tmp_path: Path, instance: str) -> None:
    """The durability report and the completion travel on two rings: when the report
    comes first, the publication settles then, and its completion does not leave it
    awaiting a second report (which vLLM's connector, never asking, would keep)."""
    with rig(tmp_path / "store", instance, **SETTINGS) as r:
        client = r.engine.client
        (sid, tokens), = sequences(1, r.cfg.page_tokens, seed=4).items()
        assert r.engine.publish(sid, tokens, tries=1)
        r.capture._step(0)
        conn = client._connection()
        held = conn.completion.pop_batch(256, timeout=0)  # the completion, held back
        for _ in range(3):
            r.commit._step(0)
        client.poll_completions()
        assert client.counters.durable == 1 and client.pending == 1
        r.capture.completion.push_batch(held)
        released = client.poll_completions()
        assert [c.status for c in released] == ["captured"]
        assert client.pending == 0 and client.awaiting_durable == 0
        assert client.counters.durable == 1


def test_a_lease_whose_commit_fails_fails_one_publication(
        tmp_path: Path, instance: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Capture leases the stored prefix of a publication in a write transaction; one whose
    COMMIT fails (OutcomeUnknown, a StoreError: the disk full for a moment) fails that
    publication alone, where it used to end capture for good (exit 4, FATAL)."""
    from sparkcache.store.index import OutcomeUnknown

    with rig(tmp_path / "store", instance, **SETTINGS) as r:
        (s1, t1), (s2, t2) = sequences(2, r.cfg.page_tokens, seed=6).items()
        real = r.capture.store.lease_prefix
        calls = []

        def lease_once_unknown(keys, seconds, lease=0):
            calls.append(keys)
            if len(calls) == 1:
                raise OutcomeUnknown("COMMIT failed: database or disk is full")
            return real(keys, seconds, lease)

        monkeypatch.setattr(r.capture.store, "lease_prefix", lease_once_unknown)
        assert r.engine.publish(s1, t1, tries=1)
        r.step(3)
        assert r.engine.client.counters.capture_failed["failed"] == 1
        assert r.capture.life.item_errors == 1
        assert r.engine.publish(s2, t2, tries=1)
        r.step(3)
        assert s2 in r.engine.acknowledged


def test_a_publication_copied_just_before_its_deadline_is_still_acknowledged(
        tmp_path: Path, instance: str) -> None:
    """Capture checked the deadline just before it passed, the client released the blocks
    by it just after: the late completion and commit's report are still taken, so the
    stored root is acknowledged durable instead of its report being dropped."""
    with rig(tmp_path / "store", instance, **SETTINGS) as r:
        client = r.engine.client
        (sid, tokens), = sequences(1, r.cfg.page_tokens, seed=8).items()
        assert r.engine.publish(sid, tokens, tries=1)
        for entry in client._pending.values():
            entry.deadline = 0.0  # the client's clock passed it first
        assert [c.status for c in client.poll_completions()] == ["expired"]
        r.capture._step(0)  # capture's own check: the deadline it was given still holds
        for _ in range(3):
            r.commit._step(0)
        client.poll_completions()
        assert client.counters.durable == 1 and client.awaiting_durable == 0
        assert [(d.seq_id, d.durable) for d in client.poll_durable()] == [(sid, True)]


def test_a_peer_whose_record_stays_torn_is_taken_for_gone(
        tmp_path: Path, instance: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Commit drains until capture is gone (Lifecycle.peer_running). A capture killed in
    the middle of a stats write leaves its record torn for good: read torn for longer than
    TORN_PEER_S, it is taken for gone, so commit's drain ends."""
    from sparkcache.shm import stats as stats_mod
    from sparkcache.workers import lifecycle
    from sparkcache.workers.lifecycle import Role

    monkeypatch.setattr(lifecycle, "TORN_PEER_S", 0.2)
    with rig(tmp_path / "store", instance, **SETTINGS) as r:
        life = r.commit.life
        assert life.peer_running(Role.CAPTURE)  # this process wrote it: alive
        block = life._stats
        stats_mod._HEAD.pack_into(block._mm, block._at(int(Role.CAPTURE)), 7, 0)  # odd
        assert life.peer_running(Role.CAPTURE)  # mid-write, maybe: asked again
        time.sleep(0.3)
        assert not life.peer_running(Role.CAPTURE)
        r.capture.life.beat()  # a whole record again
        assert life.peer_running(Role.CAPTURE)
