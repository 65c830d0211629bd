"""What ``sparkcache top`` shows, gathered apart from how it is drawn: one ``Frame`` of
dataclasses per refresh, which the live view renders, ``--once`` prints and ``--json``
dumps.

Process figures (cores, CPU, RSS, I/O, context switches) come from psutil; a worker's
state and heartbeat come from the same reading the supervisor's ``/metrics`` takes
(``sparkcache.metrics.reading``, through ``sparkcache.instance``), so top and the
endpoint never disagree about who is up. Rates are per second between two samples of the
same process, so the first frame of a process has none (``None``), as in top.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from sparkcache import activity
from sparkcache.instance import Instance
from sparkcache.metrics import reading
from sparkcache.metrics.reading import WorkerReading
from sparkcache.workers.lifecycle import State


@dataclass(frozen=True)
class ProcessFigures:
    """One worker process as psutil sees it; a rate is None at the process's first
    sample (there is nothing to take it against yet)."""

    cores: list[int] | None  # its CPU affinity
    cpu_percent: float | None  # of one core, like top: 200 is two cores busy
    rss_bytes: int | None
    read_bytes_per_s: float | None  # storage I/O (/proc/<pid>/io read_bytes)
    write_bytes_per_s: float | None
    ctx_switches_per_s: float | None  # voluntary + involuntary
    ctx_switches: int | None  # in all, since the process started


@dataclass(frozen=True)
class WorkerRow:
    name: str  # sparkcache::<role>[r<rank>]
    role: str
    rank: int
    pid: int | None  # the supervisor's current process of this worker; None while down
    state: str  # the supervisor's: RUNNING, STARTING, BACKOFF, KILLING, FATAL, STOPPED
    report_state: str | None  # the worker's own record (READY ...), None without a live one
    heartbeat_age_s: float | None  # age of the slot's last report, whoever wrote it
    up: bool  # the /healthz test for this worker
    why_down: str
    restarts: int
    last_exit: int | None
    process: ProcessFigures | None  # None while there is no process to look at


@dataclass(frozen=True)
class RankRow:
    rank: int
    rings: dict[str, int]  # ring -> records pushed and not yet read
    slots: dict[str, int]  # capture slots by owner: free, capture, commit
    pending_publications: int  # slots holding a publication not yet committed
    pending_bytes: int
    oldest_pending_s: float  # 0 when none
    restores_queued: int  # loads pushed, not yet taken by the restore worker
    restores_in_flight: int  # loads pushed and not yet answered (queued ones included)
    maintenance_live: bool  # the figures below are from maintenance's current process
    used_bytes: int | None
    entries: int | None
    backlog_bytes: int | None  # above the low watermark
    selected_roots: int | None
    collectable_bytes: int | None
    duty: float | None  # share of the last 10 s in slices
    episode_s: float | None  # how long the pressure episode has run; 0 when none
    refusing: bool  # at the hard cap: publications refused
    max_bytes: int
    low_watermark_bytes: int
    hard_cap_bytes: int


@dataclass(frozen=True)
class Frame:
    at: float  # time.time()
    store_dir: str
    instance: str
    supervisor_pid: int
    metrics: dict | None  # {"host", "port"} of /metrics and /healthz; None when off
    healthy: bool  # /healthz's verdict
    health: str  # and its text
    sort: str
    workers: list[WorkerRow]
    ranks: list[RankRow]
    settings: dict[str, float] = field(default_factory=dict)
    # The supervisor's activity.json: restores and hits over the last minute and since
    # its start (sparkcache.activity); None before its first sample.
    activity: dict | None = None


# Sort keys (the live view's keys choose them) -> how rows are ordered. Larger first for
# figures, as in top; role and rank ascending.
SORTS: dict[str, Callable[[WorkerRow], tuple]] = {
    "rank": lambda w: (w.rank, w.role),
    "role": lambda w: (w.role, w.rank),
    "cpu": lambda w: (-_or0(w.process and w.process.cpu_percent), w.rank, w.role),
    "mem": lambda w: (-_or0(w.process and w.process.rss_bytes), w.rank, w.role),
    "io": lambda w: (-_or0(w.process and w.process.read_bytes_per_s)
                     - _or0(w.process and w.process.write_bytes_per_s), w.rank, w.role),
}


def _or0(value: float | None) -> float:
    return float(value or 0)


def sort_workers(rows: list[WorkerRow], key: str) -> list[WorkerRow]:
    if key not in SORTS:
        raise ValueError(f"sort {key!r}: expected one of {', '.join(SORTS)}")
    return sorted(rows, key=SORTS[key])


@dataclass
class _Last:
    at: float
    cpu_s: float
    read: int | None
    write: int | None
    ctx: int


class ProcessSampler:
    """psutil's view of each worker process, kept between frames so that CPU %, I/O and
    context switches are rates over the interval (a process is known by pid and start
    time: a pid reused by another process starts over)."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}
        self._last: dict[int, _Last] = {}

    def _process(self, pid: int) -> psutil.Process:
        proc = self._procs.get(pid)
        if proc is None or not proc.is_running():
            proc = self._procs[pid] = psutil.Process(pid)
            self._last.pop(pid, None)
        return proc

    def sample(self, pid: int | None) -> ProcessFigures | None:
        if pid is None:
            return None
        try:
            proc = self._process(pid)
            with proc.oneshot():
                now = time.monotonic()
                times = proc.cpu_times()
                rss = proc.memory_info().rss
                ctx = sum(proc.num_ctx_switches())
                try:
                    cores: list[int] | None = proc.cpu_affinity()
                except (psutil.Error, AttributeError):
                    cores = None
                try:
                    io = proc.io_counters()
                    read, write = int(io.read_bytes), int(io.write_bytes)
                except (psutil.Error, AttributeError):  # no /proc/<pid>/io here
                    read = write = None
        except psutil.Error:
            self._procs.pop(pid, None)
            self._last.pop(pid, None)
            return None
        cpu_s = float(times.user + times.system)
        last = self._last.get(pid)
        self._last[pid] = _Last(now, cpu_s, read, write, ctx)
        if last is None or now <= last.at:
            return ProcessFigures(cores, None, rss, None, None, None, ctx)
        dt = now - last.at

        def rate(new: float | None, old: float | None) -> float | None:
            return None if new is None or old is None else max(0.0, (new - old) / dt)

        return ProcessFigures(
            cores, 100.0 * max(0.0, cpu_s - last.cpu_s) / dt, rss,
            rate(read, last.read), rate(write, last.write), rate(ctx, last.ctx), ctx,
        )

    def forget_others(self, pids: set[int]) -> None:
        """Drop processes no longer shown (restarted workers' predecessors)."""
        for pid in set(self._procs) - pids:
            self._procs.pop(pid, None)
            self._last.pop(pid, None)


def _worker_row(w: WorkerReading, figures: ProcessFigures | None) -> WorkerRow:
    info = w.info
    report = None
    if w.live and w.record is not None:
        try:
            report = State(int(w.record.state)).name
        except ValueError:
            report = f"state {int(w.record.state)}"
    return WorkerRow(
        name=info.name, role=info.role, rank=info.rank, pid=info.pid, state=info.state,
        report_state=report, heartbeat_age_s=w.age_s, up=w.up, why_down=w.why_down,
        restarts=info.restarts, last_exit=info.last_exit, process=figures,
    )


def _rank_row(r: reading.RankReading, maintenance: WorkerReading | None,
              loads: tuple[int, int, int], settings: dict[str, float], now: float) -> RankRow:
    pushed, taken, answered = loads
    rec = maintenance.record if maintenance is not None and maintenance.live else None
    max_b, low_b = int(settings["max_bytes"]), int(settings["low_watermark_bytes"])

    def field_of(name: str) -> int | None:
        return None if rec is None else int(getattr(rec, name))

    return RankRow(
        rank=r.rank, rings=dict(r.rings), slots=dict(r.slots),
        pending_publications=r.pending_slots, pending_bytes=r.pending_bytes,
        oldest_pending_s=r.oldest_pending_s,
        restores_queued=max(0, pushed - taken),
        restores_in_flight=max(0, pushed - answered),
        maintenance_live=rec is not None,
        used_bytes=field_of("used_bytes"), entries=field_of("entries"),
        backlog_bytes=field_of("backlog"), selected_roots=field_of("selected_roots"),
        collectable_bytes=field_of("collectable_bytes"),
        duty=None if rec is None else float(rec.duty),
        episode_s=None if rec is None else (
            max(0.0, now - float(rec.episode_since)) if rec.episode_since else 0.0),
        refusing=bool(rec is not None and rec.refusing_since),
        max_bytes=max_b, low_watermark_bytes=low_b, hard_cap_bytes=2 * max_b - low_b,
    )


def gather(inst: Instance, sampler: ProcessSampler, settings: dict[str, float],
           sort: str = "rank") -> Frame:
    """One frame of the instance now."""
    rd = inst.read()
    healthy, why = reading.health(rd)
    by_key = {(w.info.rank, w.info.role): w for w in rd.workers}
    workers = [_worker_row(w, sampler.sample(w.info.pid)) for w in rd.workers]
    sampler.forget_others({w.pid for w in workers if w.pid is not None})
    ranks = []
    for r in rd.ranks:
        seg = inst.segments[r.rank]
        pushed, taken = seg.rings["load"].batch_counts()
        answered, _ = seg.rings["loaded"].batch_counts()
        ranks.append(_rank_row(r, by_key.get((r.rank, "maintenance")),
                               (pushed, taken, answered), settings, rd.at))
    rt = inst.runtime
    return Frame(
        at=rd.at, store_dir=str(inst.store_dir), instance=rt.instance,
        supervisor_pid=rt.pid, metrics=rt.metrics, healthy=healthy, health=why, sort=sort,
        workers=sort_workers(workers, sort), ranks=ranks, settings=dict(settings),
        activity=activity.read(inst.store_dir),
    )
