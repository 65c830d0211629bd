"""The maintenance worker's loop in the test's own process (real segments and store, an
injected clock, no processes): an episode evicts from above max_bytes down to the low
watermark and stops there; the duty cap holds while the store is held at its cap; the
hard cap refuses publications, shows it in the stats, and publishing resumes by itself;
the backlog is in the stats slot."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from eviction_util import FakeClock
from sparkcache.shm.layouts import split_key
from sparkcache.workers.lifecycle import Role
from worker_rig import Rig, rig

from sparkcache import segments
from sparkcache.client import HEALTH_CACHE_S
from sparkcache.config import KiB
from sparkcache.protocol import RequestKind, new_lease_id
from sparkcache.store.fsck import fsck
from sparkcache.store.objects import record_span
from sparkcache.store.store import PUNCH_DELAY_S
from sparkcache.store.testing import make_root

PAGE = 16 * KiB
# 20 pages to max_bytes, 10 to the low watermark, 30 to the hard cap; leases end at once.
SETTINGS = {"max_bytes": "320KiB", "low_watermark_bytes": "160KiB", "lease_seconds": "0",
            "maintenance_slice_bytes": "64KiB"}


def put(r: Rig, pages: int) -> None:
    """A root of ``pages`` fresh pages, committed straight into the store."""
    keys = [os.urandom(16).hex() for _ in range(pages)]
    r.commit.store.commit(make_root(os.urandom(16).hex(), keys, PAGE))


def drive(r: Rig, clock: FakeClock, turns: int) -> None:
    """Turns of the maintenance loop; its pauses pass on the injected clock."""
    for _ in range(turns):
        pause = r.maintenance.step()  # (not `now += step()`: step reads the clock too)
        clock.now += pause


def maintenance_record(r: Rig):
    with segments.attach_stats(r.cfg, 0) as stats:
        return stats.read(int(Role.MAINTENANCE))


def test_an_episode_evicts_down_to_the_low_watermark_and_stops_there(
        tmp_path: Path, instance: str) -> None:
    clock = FakeClock(tick=1e-4)
    with rig(tmp_path / "store", instance, clock=clock, **SETTINGS) as r:
        for _ in range(5):
            put(r, 4)  # 320 KiB: at max_bytes, not above
        drive(r, clock, 50)
        rec = maintenance_record(r)
        assert rec.used_bytes == 320 * KiB and rec.evicted_roots == 0
        assert rec.episode_since == 0 and rec.backlog == 160 * KiB
        put(r, 4)  # 384 KiB: an episode starts
        drive(r, clock, 1)
        rec = maintenance_record(r)
        assert rec.episode_since > 0 and rec.over_max_bytes == 64 * KiB
        assert rec.reclaimed_bytes + rec.collectable_bytes > 0
        drive(r, clock, 200)
        rec = maintenance_record(r)
        # Down to the low watermark to the page, and no further.
        assert 160 * KiB - PAGE < rec.used_bytes <= 160 * KiB, rec
        assert rec.episode_since == 0 and rec.over_max_bytes == 0
        assert rec.reclaimed_bytes == rec.collected_bytes == 384 * KiB - rec.used_bytes
        assert rec.collectable_objects == 0 and rec.selected_bytes < 64 * KiB
        assert rec.evicted_roots >= 3 and rec.collected_objects * PAGE == rec.collected_bytes
        assert 0 < rec.slice_last_s <= rec.slice_max_s <= 0.02
        # Collection's deletes made durable after the slices, outside them.
        assert 0 < rec.index_sync_max_s <= rec.index_sync_s
        # Collected files pooled up to the watermarks' gap (160 KiB: two of the packs of
        # four block-aligned records that each put wrote), the rest unlinked.
        pooled = 4 * record_span(PAGE)
        assert rec.pooled_bytes == 160 * KiB // pooled * pooled == 2 * pooled
        evicted = rec.evicted_roots
        put(r, 4)
        put(r, 4)  # between the watermarks again: no new episode
        drive(r, clock, 50)
        rec = maintenance_record(r)
        assert rec.evicted_roots == evicted and rec.used_bytes > 160 * KiB
        assert rec.episode_since == 0
        assert rec.pooled_bytes == 0  # the two commits overwrote them
    assert fsck(tmp_path / "store", grace_seconds=0).ok


def test_the_duty_cap_holds_while_the_store_is_held_at_its_cap(
        tmp_path: Path, instance: str) -> None:
    """Every clock reading costs 0.2 ms, so slices take time; roots keep coming whenever
    used bytes fall below max_bytes. Slices keep their time budget, the duty reported
    (the last 10 s) never passes 20 %, and maintenance keeps the store below the hard
    cap."""
    clock = FakeClock(tick=2e-4)
    with rig(tmp_path / "store", instance, clock=clock, **SETTINGS) as r:
        m = r.maintenance
        worst, seen = 0.0, []
        while clock.now < 1000.0 + 30:
            if m.store.usage().used_bytes <= 320 * KiB:
                put(r, 3)
            pause = m.step()
            clock.now += pause
            worst = max(worst, m.life.report["duty"])
            seen.append(m.life.report["duty"])
        rec = maintenance_record(r)
        assert rec.slice_max_s <= 0.02
        assert worst <= 0.2 + 1e-6
        assert max(seen[len(seen) // 2:]) >= 0.1  # it did work at its cap meanwhile
        assert rec.evicted_roots > 20 and rec.refused_s == 0


def test_the_hard_cap_refuses_publications_then_publishing_resumes(
        tmp_path: Path, instance: str) -> None:
    clock = FakeClock()
    with rig(tmp_path / "store", instance, clock=clock, **SETTINGS) as r:
        for _ in range(8):
            put(r, 4)  # 512 KiB: past the hard cap (480 KiB)
        r.maintenance.report()
        engine = r.engine
        assert not engine.publish("a", list(range(64)), tries=1)
        assert engine.client.counters.skipped["store_full"] == 1
        rec = maintenance_record(r)
        assert rec.refusing_since > 0
        clock.now += 5
        r.maintenance.report()
        assert maintenance_record(r).refused_s == 5.0  # a refusal that lasts is visible
        for _ in range(100):
            if maintenance_record(r).used_bytes < 480 * KiB:
                break
            r.maintenance.slice()
            r.maintenance.report()
        rec = maintenance_record(r)
        assert rec.refusing_since == 0 and rec.refused_s == 5.0
        time.sleep(HEALTH_CACHE_S + 0.05)  # how long the client trusts the fill it read
        assert engine.publish("a", list(range(64)), tries=1), engine.client.counters
        r.step(3)
        assert "a" in engine.acknowledged
        # The commit's wait for the index's write lock is in commit's stats.
        with segments.attach_stats(r.cfg, 0) as stats:
            commit = stats.read(int(Role.COMMIT))
        assert commit.lock_wait_s > 0 and commit.lock_wait_max_s <= commit.lock_wait_s


def test_a_slice_far_over_its_budget_is_logged_with_its_longest_step(
        tmp_path: Path, instance: str, caplog) -> None:
    """Every clock reading costs 30 ms, so each slice overruns its 20 ms budget: the
    worker says so, naming the step that took longest, once a minute at most."""
    clock = FakeClock(tick=0.03)
    with rig(tmp_path / "store", instance, clock=clock, **SETTINGS) as r:
        for _ in range(6):
            put(r, 4)  # above max_bytes: an episode
        with caplog.at_level(logging.WARNING, logger="sparkcache.workers.maintenance"):
            drive(r, clock, 5)
        assert maintenance_record(r).slice_max_s > 0.04
    warned = [m for m in caplog.messages if "against its budget of 20 ms" in m]
    assert len(warned) == 1, caplog.messages
    assert "longest step: 1 " in warned[0] and "unit(s) in " in warned[0]


def test_a_slice_that_only_punches_counts_against_the_caps(
        tmp_path: Path, instance: str) -> None:
    """Collected records of a pack still named are punched after a delay, in slices of
    their own when nothing else is waiting, no more bytes a slice than its budget: such
    a slice is work like any other, so the duty and I/O caps and the slice statistics
    see it."""
    clock = FakeClock(tick=1e-4)
    with rig(tmp_path / "store", instance, clock=clock, **SETTINGS) as r:
        m = r.maintenance
        shared = [os.urandom(16).hex() for _ in range(2)]
        old = os.urandom(16).hex()
        own = [os.urandom(16).hex() for _ in range(6)]
        r.commit.store.commit(make_root(old, shared + own, PAGE))  # one pack of 8
        other = [*shared, os.urandom(16).hex()]
        r.commit.store.commit(make_root(os.urandom(16).hex(), other, PAGE))  # keeps it named
        m.store.remove_roots([old])
        drive(r, clock, 20)
        assert m.store.usage().collectable_objects == 0 and not m.store.unlinking.objects
        assert m.store._deferred  # the six records wait for their punch
        for name in m.store._deferred:
            m.store._deferred[name].since -= PUNCH_DELAY_S  # due now
        spans, slices = len(m.pacing.duty._spans), 0
        while m.store._deferred:
            assert m.slice()
            slices += 1
            assert slices < 20
        # Six records are more than a slice's 64 KiB: punched a piece a slice.
        assert slices > 1
        assert len(m.pacing.duty._spans) == spans + slices


def test_what_a_crash_left_is_swept_once_the_grace_after_the_start_is_over(
        tmp_path: Path, instance: str) -> None:
    """A start sweeps no file before READY (a sweep reads every row: past the READY limit
    at millions of rows). A crash between collection's delete and its unlink leaves an
    orphan, of any age; once the grace for in-flight commits' files is over the worker
    sweeps every key prefix, as many a slice as its time affords, and removes it."""
    clock = FakeClock(tick=1e-4)
    with rig(tmp_path / "store", instance, clock=clock, **SETTINGS) as r:
        m = r.maintenance
        put(r, 4)
        key = os.urandom(16).hex()
        orphans = [m.store.layout.objects_dir / k[:2] / f"{k}.{os.urandom(8).hex()}"
                   for k in (key, "ff" + key[2:])]
        for orphan in orphans:
            orphan.parent.mkdir(exist_ok=True)
            orphan.write_bytes(bytes(8192))  # its row deleted, then the crash
            os.utime(orphan, (time.time() - 3600,) * 2)
        m.store.check_index()  # what run() does first: no file is swept
        drive(r, clock, 20)
        assert all(orphan.exists() for orphan in orphans)  # not before the grace is over
        clock.now += 60
        for _ in range(5000):
            if not m._resweep:
                break
            clock.now += m.step()
        assert not any(orphan.exists() for orphan in orphans) and not m._resweep
        assert m.life.report["slice_max_s"] <= 0.02
    assert fsck(tmp_path / "store", grace_seconds=0).ok


def test_a_release_taken_before_its_lease_from_another_ring_still_ends_it(
        tmp_path: Path, instance: str) -> None:
    """The scheduler leases through the ``lease`` ring, the engine's client releases
    through ``request``, which maintenance drains first: the release is in the store's
    hands only once both rings are drained, so it ends the lease, even with a batch of
    touches written in the middle of the drain (the store's batch of 64 filled)."""
    with rig(tmp_path / "store", instance, **SETTINGS) as r:
        keys = [os.urandom(16).hex() for _ in range(3)]
        r.commit.store.commit(make_root(os.urandom(16).hex(), keys, PAGE))
        lease = new_lease_id()
        r.lease.try_push((int(RequestKind.LEASE), 0, *split_key(keys[-1]), 2, lease,
                          time.time(), 30.0))
        r.engine.client.release(lease)
        r.engine.client.release(lease)  # duplicated: one release of the batch
        for _ in range(70):  # the store writes its batch at the 64th, mid-drain
            r.engine.client._request(RequestKind.TOUCH, os.urandom(16).hex(), 0)
        assert r.maintenance._take_requests() == 73
        r.maintenance.store.flush_touches()
        assert r.maintenance.store._rconn.execute("SELECT count(*) FROM reads").fetchone() \
            == (0,)
        r.maintenance.report()
        assert maintenance_record(r).read_releases == 1


def test_a_drain_ends_though_the_engine_never_stops_pushing(
        tmp_path: Path, instance: str) -> None:
    """Maintenance drains its rings holding the write lock and the gate: it takes what a
    ring held when the drain began, at most its capacity, never "until empty" (a ring
    that replayed records forever held both for good)."""
    with rig(tmp_path / "store", instance, **SETTINGS) as r:
        ring = r.maintenance.requests[1]
        touch = (int(RequestKind.TOUCH), 0, *split_key(os.urandom(16).hex()), 0, 0,
                 time.time(), 0.0)
        pops = 0

        class Endless:
            """The lease ring, with the scheduler pushing again at every pop."""

            capacity = ring.capacity

            def pop_batch(self, n: int, timeout: float = 0) -> object:
                nonlocal pops
                pops += 1
                assert pops <= 2 * ring.capacity, "the drain never ended"
                r.lease.try_push(touch)
                return ring.pop_batch(n, timeout)

        r.maintenance.requests[1] = Endless()
        assert r.maintenance._take_requests() == ring.capacity
        r.maintenance.requests[1] = ring
