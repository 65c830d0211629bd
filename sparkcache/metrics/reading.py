"""One reading of a running instance, taken at scrape time: every worker's stats record
(with its age now, and whether it is the report of the live process), every rank's
capture slots by owner, pending publications and ring depths, the supervisor's state of
each worker, and the counters the engine's processes published (``engine_stats``). The
collector turns a reading into metrics and the health check judges it; nothing here is
cached between readings, so an age advances at every one while the engine is idle, and a
dead worker reads as down, not as its last report.

Only the stats blocks' seqlock (plus CRC) orders what is read here; the arena's slot
states and the ring counters are read without synchronisation, as gauges (docs/shm.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sparkcache.config import Config
from sparkcache.engine_stats import WRITERS
from sparkcache.metrics.carry import Carry
from sparkcache.segments import OWNER_CAPTURE, OWNER_COMMIT, RankSegments
from sparkcache.shm import FREE, TornRead
from sparkcache.workers.lifecycle import State

# Arena owner value -> the ``owner`` label of the capture slot gauge.
OWNERS = {FREE: "free", OWNER_CAPTURE: "capture", OWNER_COMMIT: "commit"}
# A worker whose last beat is older than this is not healthy (it beats every 0.2 s when
# idle and every 0.5 s during a long step: workers.lifecycle). The supervisor's own limit
# (heartbeat_timeout_s, 10 s by default) is when it kills; health says so much sooner.
FRESH_S = 2.0


@dataclass(frozen=True)
class WorkerInfo:
    """What the supervisor knows of one worker (a snapshot; its own thread changes it)."""

    rank: int
    role: str  # capture, commit, maintenance, restore
    slot: int  # its slot in the rank's stats block
    name: str  # sparkcache::<role>[r<rank>]
    state: str  # sparkcache.supervisor_states.WorkerState value
    pid: int | None  # its current process, if any
    restarts: int
    last_exit: int | None
    carry: Carry


@dataclass(frozen=True)
class Source:
    """Where a reading comes from: the supervisor's settings, its rank segments (which it
    owns; empty before they exist or after they are unlinked) and its workers."""

    cfg: Config
    segments: Callable[[], Sequence[RankSegments]]
    workers: Callable[[], Sequence[WorkerInfo]]


@dataclass(frozen=True)
class WorkerReading:
    info: WorkerInfo
    record: tuple | None  # the slot's WORKER_STATS record, of whichever process wrote it
    age_s: float | None  # now - its heartbeat; None without a record
    live: bool  # the record is the current process's own
    up: bool  # RUNNING, its own record READY, beat within FRESH_S
    why_down: str  # empty when up
    totals: dict[str, float]  # counters, dead processes' included (Carry)


@dataclass(frozen=True)
class RankReading:
    rank: int
    slots: dict[str, int]  # owner label -> capture slots
    pending_slots: int  # slots holding a publication not yet committed
    pending_bytes: int  # bytes of those slots handed to commit
    oldest_pending_s: float  # age of the oldest such hand-over; 0 when none
    rings: dict[str, int]  # ring -> records pushed, not yet read


@dataclass(frozen=True)
class EngineReading:
    """One engine-side writer's last record (shm.layouts.ENGINE_STATS)."""

    rank: int
    writer: str  # engine_stats.WRITERS: client, lookup
    record: tuple  # counters of the writing process, from 0 at its start
    age_s: float  # now - its time of writing


@dataclass(frozen=True)
class Reading:
    at: float  # time.time() of the reading
    workers: list[WorkerReading]
    ranks: list[RankReading]
    segments_ready: bool
    engines: list[EngineReading] = field(default_factory=list)  # slots written so far


def _read_record(seg: RankSegments, slot: int) -> tuple | None:
    try:
        return seg.stats.read(slot, retries=64)
    except TornRead:
        return None  # stopped (SIGSTOP) or killed in the middle of a write


def read_worker(info: WorkerInfo, seg: RankSegments | None, now: float) -> WorkerReading:
    record = _read_record(seg, info.slot) if seg is not None else None
    # The record first, then the carry (Carry's notes say why this order counts once).
    totals = dict(info.carry.totals(record))
    age = None if record is None else max(0.0, now - float(record.heartbeat))
    live = record is not None and info.pid is not None and int(record.pid) == info.pid
    why = ""
    if info.state != "RUNNING":
        exit_code = "" if info.last_exit is None else f", last exit code {info.last_exit}"
        why = f"state {info.state}{exit_code}"
    elif not live:
        why = "no report from its current process"
    elif int(record.state) != State.READY:
        why = f"reports {State(int(record.state)).name}"
    elif age is not None and age >= FRESH_S:
        why = f"no heartbeat for {age:.1f}s (limit {FRESH_S:g}s)"
    return WorkerReading(info, record, age, live, not why, why, totals)


def read_rank(seg: RankSegments, monotonic_now: float) -> RankReading:
    slots = dict.fromkeys(OWNERS.values(), 0)
    pending = pending_bytes = 0
    oldest = 0.0
    for st in seg.arena.state.tolist():  # (owner, pid, generation, since, used, pid_start)
        owner, since, used = st[0], st[3], st[4]
        label = OWNERS.get(owner, f"unknown_{owner}")
        slots[label] = slots.get(label, 0) + 1
        if owner in (OWNER_CAPTURE, OWNER_COMMIT):
            pending += 1
            oldest = max(oldest, monotonic_now - since)
            if owner == OWNER_COMMIT:
                pending_bytes += used
    rings = {name: ring.depth() for name, ring in seg.rings.items()}
    return RankReading(seg.rank, slots, pending, pending_bytes, max(0.0, oldest), rings)


def read_engines(seg: RankSegments, now: float) -> list[EngineReading]:
    """The engine records of a rank, of the slots ever written (none without a block)."""
    out = []
    if seg.engine is None:
        return out
    for slot, writer in WRITERS.items():
        try:
            record = seg.engine.read(slot, retries=64)
        except TornRead:
            continue  # a writer stopped in the middle of a write: its last is unknown
        if record is not None:
            out.append(EngineReading(seg.rank, writer, record,
                                     max(0.0, now - float(record.written))))
    return out


def read(source: Source) -> Reading:
    """Read everything now."""
    return read_from(source.segments(), source.workers())


def read_from(rank_segments: Sequence[RankSegments], infos: Sequence[WorkerInfo]) -> Reading:
    """Read everything now from these segments (the supervisor's own, or another
    process's read-only mappings: ``sparkcache.instance``) and workers."""
    now, mono = time.time(), time.monotonic()
    segs = list(rank_segments)
    by_rank = {seg.rank: seg for seg in segs}
    workers = [read_worker(info, by_rank.get(info.rank), now) for info in infos]
    ranks = [read_rank(seg, mono) for seg in segs]
    engines = [e for seg in segs for e in read_engines(seg, now)]
    return Reading(now, workers, ranks, bool(segs), engines)


def health(reading: Reading) -> tuple[bool, str]:
    """(healthy, why): healthy only while every worker is up; otherwise one line per
    worker that is not, naming why."""
    if not reading.segments_ready:
        return False, "not started: the supervisor has no segments (starting or stopping)"
    down = [w for w in reading.workers if not w.up]
    if not reading.workers:
        return False, "no workers"
    if not down:
        return True, f"ok: {len(reading.workers)} workers READY with a fresh heartbeat"
    return False, "\n".join(f"{w.info.name}: {w.why_down}" for w in down)
