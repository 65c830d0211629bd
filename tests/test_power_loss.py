"""The store under the power-loss harness (``power_loss.py``): commits of packs (one
recycling a pooled file), eviction, collection (its deletions synced after the slice,
files pooled, a pack's records punched) and the sweep, recorded; then every crash state
at every point of the log must pass fsck before and after a repair and restore every
root exactly, acknowledged ones included (a larger run: POWER_LOSS_ROUNDS=5). And the
harness must fail a store that leaves out the sync of its commits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from eviction_util import FakeClock, evict, meter
from power_loss import Recording, RecordingOps, Verdict, check_states, recording_index

from sparkcache.maintenance_policy import CostModel
from sparkcache.store import PageStore
from sparkcache.store.recovery import sweep_units
from sparkcache.store.store import PUNCH_DELAY_S
from sparkcache.store.testing import make_root

PAGE = 4096
# The workload's rounds (a larger size on request: POWER_LOSS_ROUNDS=5), and
# how many points of the log get crash states (all, or that many spread evenly).
ROUNDS = int(os.environ.get("POWER_LOSS_ROUNDS", "1"))
POINTS = os.environ.get("POWER_LOSS_POINTS", "all")


def keys(n: int) -> list[str]:
    return [os.urandom(16).hex() for _ in range(n)]


def workload(store: PageStore, rec: Recording, clock: FakeClock) -> None:
    """What commit and maintenance do to a store, each step recorded."""
    costs = CostModel()  # learnt once: every later slice affords all it is given
    ids = {name: os.urandom(16).hex() for name in "abcde"}

    def commit(name: str, ks: list[str]) -> None:
        store.commit(make_root(ids[name], ks, PAGE))
        rec.acked.append((len(rec.log), ids[name]))

    def removed(gone: tuple[str, ...]) -> None:
        rec.evicted += [(len(rec.log), rid) for rid in gone]

    def collect(sync: bool = True) -> None:
        store.collect(64, meter(costs=costs))  # rows deleted unsynced; earlier ones' files go
        if sync:
            store.sync_collected()

    a = keys(8)
    commit("a", a)  # a pack of 8 records
    commit("b", [*keys(4), *a[:3]])  # a pack of 4; three pages deduplicated into a's
    commit("c", keys(6))
    removed(evict(store, 1).removed)
    collect()  # the evicted root's rows deleted, then synced
    collect()  # its files unlinked or pooled, or its records' punches deferred
    clock.now += PUNCH_DELAY_S + 1
    collect()  # punched
    left = [rid for rid in ids.values() if rid not in {r for _, r in rec.evicted}][:2]
    removed(store.remove_roots(left[:1]).removed)
    collect()
    collect()  # whole packs into the pool
    commit("d", keys(5))  # recycles a pooled file
    removed(store.remove_roots([ids["d"]]).removed)
    collect(sync=False)  # a slice that raised before its sync
    store.sweep(sweep_units(2), grace_seconds=0)  # syncs the WAL, then frees d's pack
    commit("e", keys(3))


def run(tmp_path: Path, drop_syncs: frozenset[str] = frozenset(),
        points: str = POINTS) -> tuple[Recording, Verdict]:
    store_dir = tmp_path / "store"
    clock = FakeClock(now=1_000_000.0)
    with PageStore(store_dir, 0, lease_seconds=0):
        pass  # the rank directory, for the recorder's paths
    rec = Recording((store_dir / "rank-0").resolve())
    with (recording_index(rec, store_dir / "rank-0" / "index.sqlite", tmp_path / "index")
          as take,
          PageStore(store_dir, 0, lease_seconds=0, fileops=RecordingOps(rec, drop_syncs),
                    pool_bytes=1 << 20, clock=clock) as store):
        take(True)
        for _ in range(ROUNDS):
            workload(store, rec, clock)
    return rec, check_states(rec, tmp_path / "check", PAGE, subsets=4,
                             points=None if points == "all" else int(points))


@pytest.mark.slow
def test_every_crash_state_of_commit_and_maintenance_is_consistent(tmp_path: Path) -> None:
    rec, verdict = run(tmp_path)
    kinds = {c.kind for c in rec.log}
    assert {"write", "rename", "unlink", "punch", "syncfs", "truncate"} <= kinds, kinds
    print(f"power-loss harness: {verdict.states} crash states at {POINTS} of "
          f"{len(rec.log)} points of the log, {len(rec.index)} index states")
    assert verdict.states >= 150 * ROUNDS
    assert not verdict.failures, verdict.failures[:5]


@pytest.mark.slow
def test_the_harness_fails_a_store_without_the_sync_of_its_commits(tmp_path: Path) -> None:
    """Without commit's ``syncfs`` an acknowledged root's pack may not be on the disk when
    its rows are: the harness must see it. (Without collection's WAL sync this workload
    still passes: a synced transaction of the store came between each deletion and the
    free that followed it, and made the deletion durable with it.)"""
    _, verdict = run(tmp_path, drop_syncs=frozenset({"syncfs"}), points="8")
    print(f"without syncfs: {len(verdict.failures)} of {verdict.states} crash states "
          f"failed, the first: {verdict.failures[:1]}")
    assert verdict.failures, f"{verdict.states} states, none failed"
