"""SIGKILL each worker at every step of the pipeline protocol, one step per case, and check
the invariants after it restarts.

The kill is deterministic: the supervisor's workers run with $SPARKCACHE_KILL_AT=<step>,
and the worker that reaches that checkpoint while the kill file exists unlinks it and
SIGKILLs itself (``workers.lifecycle.checkpoint``). Steps: capture's four hand-offs,
commit's own four plus the store's commit steps (through the ``PageStore`` hook), and the
store's eviction and collection steps in maintenance.

Each case publishes a first batch (the kill happens there: capture and commit steps at
the first publication, ``maintenance.requests`` when the first lease or touch arrives,
the other maintenance steps at the first eviction pass), then a second batch once the
killed worker is back, and checks: the step was reached (kill file gone), that worker
restarted and runs, no other did; every captured first-batch publication is acknowledged
where commit was killed (its successor redoes what it held), and every second-batch one
in every case (a worker that came back short of slots would refuse them: one capture
slot makes a lost slot visible); every acknowledged publication is in the store and
restores byte for byte; every slot ends FREE; the engine got every block back; no engine
call took 0.25 s; the supervisor stops with 0, fsck is clean and nothing is left in
/dev/shm.

Maintenance cases evict with a zero lease, so an acknowledged root may be evicted (or
its commit refused, when a page capture skipped as stored was collected meanwhile):
there "in the store" weakens to "whatever the store holds restores byte for byte", and
eviction must bring used bytes back under ``max_bytes`` with no collectable object left.

Every step is reached deterministically (each case checks it). One more case kills commit
after committing a sequence's first turn while its second turn is captured meanwhile: the
restarted commit must not redo the old turn over the acknowledged new one.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from pipeline_util import (
    SyntheticEngine,
    check_restores,
    pipeline,
    runtime,
    sequences,
    wait_committed,
)
from sparkcache.shm import FREE, StatsBlock
from sparkcache.workers.lifecycle import KILL_AT_ENV, KILL_FILE_ENV, Role, State

from sparkcache import segments
from sparkcache.store import PageStore
from sparkcache.store.fileops import COMMIT_STEPS, EVICTION_STEPS
from sparkcache.store.objects import HEADER_SIZE
from sparkcache.store.pool import free_name

pytestmark = pytest.mark.slow

CAPTURE_STEPS = ("capture.slot_taken", "capture.copied", "capture.handed", "capture.filled")
COMMIT_WORKER_STEPS = ("commit.popped", *COMMIT_STEPS, "commit.committed", "commit.acknowledged",
                       "commit.slot_freed")
STEPS = (*CAPTURE_STEPS, *COMMIT_WORKER_STEPS, "maintenance.requests", *EVICTION_STEPS)

FIRST, SECOND = 12, 8
RELEASE_S = 2.0
ACK_SETTLE_S = 2.0
# One slot: a slot the pipeline loses stalls everything after it instead of hiding.
PIPELINE = {"capture_slots": "1", "release_timeout_seconds": str(RELEASE_S)}
# Pages are 16 KiB: the first batch alone crosses max_bytes; a zero lease makes every
# root a victim at once, and short lookup leases (capture's too) end soon after. A slice
# may handle two pages, so roots are cut short across slices (evict.truncated).
# Files the pool does not take are removed in halves (collect.shrunk).
EVICTING = {"max_bytes": "192KiB", "low_watermark_bytes": "96KiB", "lease_seconds": "0",
            "lookup_lease_seconds": "1", "maintenance_slice_bytes": "32KiB",
            "maintenance_halve_bytes": "4KiB"}


def _role(step: str) -> str:
    return step.split(".")[0] if step.startswith(("capture.", "commit.")) else "maintenance"


def _publish(engine: SyntheticEngine, seqs: dict[str, list[int]]) -> None:
    """Publish ``seqs`` and wait until every block came back and each is acknowledged, or
    no acknowledgement came for ``ACK_SETTLE_S``: a killed worker's restart comes later
    (a killed capture's publications are never acknowledged; a killed commit's are, by
    its successor)."""
    for sid, tokens in seqs.items():
        engine.publish(sid, tokens)
    deadline = time.monotonic() + RELEASE_S + 5
    acked, since = len(engine.acknowledged), time.monotonic()
    while time.monotonic() < deadline:
        engine.poll()
        if len(engine.acknowledged) != acked:
            acked, since = len(engine.acknowledged), time.monotonic()
        if not engine.client.pending and (
                set(seqs) <= engine.acknowledged or time.monotonic() - since > ACK_SETTLE_S):
            break
        time.sleep(0.01)
    assert engine.client.pending == 0, engine.client.counters


def _wait(what: str, cond, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not within {timeout}s")
        time.sleep(0.05)
    return got


def _restarted(store: Path, stats: StatsBlock, role: str) -> dict:
    """Every worker's runtime entry once ``role``'s was restarted, runs, and its new
    process is READY (a restarted maintenance reports its used bytes only from then on,
    and publications wait on that)."""
    workers = {w["role"]: w for w in runtime(store)["workers"]}
    w = workers[role]
    rec = stats.read(int(Role[role.upper()]))
    if w["restarts"] >= 1 and w["state"] == "RUNNING" and rec is not None \
            and rec.pid == w["pid"] and rec.state == State.READY:
        return workers
    return {}


def _seed_pool(store: Path) -> None:
    """Pooled files for the first publication's pages to be written over (store/pool.py),
    holding bytes that are no page's."""
    PageStore(store, 0).close()
    free = store / "rank-0" / "free"
    for _ in range(FIRST * 4):
        path = free / free_name(16 * 1024 + HEADER_SIZE)
        path.write_bytes(os.urandom(16 * 1024 + HEADER_SIZE))
        path.chmod(0o600)


def _stored_exact(engine: SyntheticEngine, seqs: dict[str, list[int]]) -> None:
    """Restore what the store holds of each sequence: every restored page byte-exact."""
    for sid, tokens in seqs.items():
        restored, exact = engine.restore_exact(tokens)
        assert restored == exact, (sid, restored, exact)


@pytest.mark.parametrize("step", STEPS)
def test_worker_killed_at_step(tmp_path: Path, instance: str, step: str) -> None:
    role = _role(step)
    evicting = role == "maintenance"
    settings = {**PIPELINE, **(EVICTING if evicting else {})}
    store = tmp_path / "store"
    kill = tmp_path / "kill"
    kill.touch()
    env = {KILL_AT_ENV: step, KILL_FILE_ENV: str(kill)}
    if step == "commit.recycled":
        _seed_pool(store)
    with pipeline(store, instance, settings, env) as engine:
        cfg = engine.client.cfg
        seqs = sequences(FIRST + SECOND, seed=3)
        first = dict(list(seqs.items())[:FIRST])
        second = dict(list(seqs.items())[FIRST:])

        _publish(engine, first)
        # Lookups and restores send requests to maintenance (maintenance.requests).
        done = {s: engine.accepted[s] for s in engine.acknowledged}
        if not evicting:
            wait_committed(engine, timeout=10, settle=0.5, seqs=done)
        _stored_exact(engine, done)
        _wait(f"{step} reached", lambda: not kill.exists())
        with segments.attach_stats(cfg, 0) as stats:
            workers = _wait(f"{role} restarted", lambda: _restarted(store, stats, role))
        assert [w for r, w in workers.items() if r != role and w["restarts"]] == []
        if role == "commit":
            # Wherever commit died, its successor commits what it held and acknowledges
            # it: no acknowledgement is lost (one may come twice, counted once).
            # (Publications released by their deadline while commit was away were never
            # captured: there is nothing to acknowledge.)
            captured = set(first) & engine.captured
            deadline = time.monotonic() + 10
            while not captured <= engine.acknowledged and time.monotonic() < deadline:
                engine.poll()
                time.sleep(0.05)
            assert captured <= engine.acknowledged, (
                captured - engine.acknowledged, engine.not_durable, engine.client.counters)
            counters = engine.client.counters
            assert counters.durable == len(engine.acknowledged), counters

        _publish(engine, second)
        assert set(second) <= engine.acknowledged, str(engine.client.counters)
        acked = {s: engine.accepted[s] for s in engine.acknowledged}
        if evicting:
            _stored_exact(engine, acked)
            with PageStore(store, 0) as ps:
                _wait("eviction and collection", lambda: (
                    (u := ps.usage()).used_bytes <= cfg.max_bytes and not u.collectable_objects))
        else:
            assert wait_committed(engine, timeout=10, settle=2.0, seqs=acked) == {}
            check_restores(engine, acked)
        arena = segments.attach_arena(cfg, 0)
        try:
            _wait("every slot FREE", lambda: (arena.state["owner"] == FREE).all(), timeout=5)
        finally:
            arena.close()
        assert engine.max_call_s < 0.25, engine.max_call_s


def test_commit_redo_keeps_the_newest_turn(tmp_path: Path, instance: str) -> None:
    """Commit dies holding a committed slot of a sequence's first turn; the second turn is
    captured meanwhile (a second slot). The restarted commit must not redo the old turn
    over the new one: the acknowledged second turn stays in the store."""
    settings = {"capture_slots": "2", "release_timeout_seconds": str(RELEASE_S)}
    store = tmp_path / "store"
    kill = tmp_path / "kill"
    kill.touch()
    env = {KILL_AT_ENV: "commit.committed", KILL_FILE_ENV: str(kill)}
    with pipeline(store, instance, settings, env) as engine:
        cfg = engine.client.cfg
        tokens = next(iter(sequences(1, seed=5).values()))
        turn1, turn2 = tokens[:40], tokens[:40] + list(range(1000, 1040))
        _publish(engine, {"x": turn1})
        _wait("commit.committed reached", lambda: not kill.exists())
        _publish(engine, {"x": turn2})
        assert "x" in engine.acknowledged, engine.client.counters
        with segments.attach_stats(cfg, 0) as stats:
            _wait("commit restarted", lambda: _restarted(store, stats, "commit"))
        assert wait_committed(engine, timeout=10, settle=2.0) == {}
        check_restores(engine, {"x": turn2})
        assert engine.max_call_s < 0.25, engine.max_call_s
