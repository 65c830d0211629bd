"""What every worker process shares: roles, named lifecycle states and their allowed
transitions, the readiness handshake and heartbeat (its slot of the rank's stats block),
the process title, and signal handlers that only set a flag."""

from __future__ import annotations

import bisect
import ctypes
import importlib
import logging
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import posix_ipc
import psutil
import setproctitle
from sparkcache.shm import SegmentError, StatsBlock, TornRead
from sparkcache.shm.layouts import DROP_REASONS, DURATION_BUCKETS_S, OUTCOMES, WORKER_STATS
from sparkcache.shm.segment import process_gone, process_start

from sparkcache import segments
from sparkcache.config import Config
from sparkcache.ratelog import RateLimitedLog
from sparkcache.store import StoreError

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# Looked up at import, not in die_with_parent: a forked child then makes no dlsym call.
_prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)  # Linux only
# Test hook: a worker of role $SPARKCACHE_FAULT_ROLE exits with CRASH_EXIT at start-up
# while the file $SPARKCACHE_FAULT_FILE exists (crash-loop and fail-fast tests).
FAULT_ROLE_ENV = "SPARKCACHE_FAULT_ROLE"
FAULT_FILE_ENV = "SPARKCACHE_FAULT_FILE"
CRASH_EXIT = 3
# A fault of the worker's environment, not of one item: its segments cannot be attached or
# its store directory is unusable. Restarting cannot help, so the supervisor marks the
# worker FATAL at once instead of crash-looping it; the worker says why in one line.
ENV_FAULT_EXIT = 4
ENVIRONMENT_FAULTS: tuple[type[BaseException], ...] = (
    SegmentError, posix_ipc.ExistentialError, StoreError,
)
# Test hook: a worker SIGKILLs itself at the checkpoint named $SPARKCACHE_KILL_AT while the
# file $SPARKCACHE_KILL_FILE exists (crash tests that kill at every step of the protocol).
KILL_AT_ENV = "SPARKCACHE_KILL_AT"
KILL_FILE_ENV = "SPARKCACHE_KILL_FILE"
# Test hook: a worker of role $SPARKCACHE_FAULT_ROLE stays STARTING (beating) while the
# file $SPARKCACHE_STALL_FILE exists (a restart that never reports READY).
STALL_FILE_ENV = "SPARKCACHE_STALL_FILE"
# Read once: a checkpoint sits on every publication's path and must cost one compare.
_KILL_AT = os.environ.get(KILL_AT_ENV) if os.environ.get(KILL_FILE_ENV) else None
# This process's Lifecycle, so that checkpoints beat while a long step makes progress.
_LIFE: Lifecycle | None = None
# How often a step in progress beats: well inside the supervisor's heartbeat limit (>= 1 s).
PROGRESS_BEAT_S = 0.5
# How long a peer's stats record may read torn before its writer is taken for killed
# mid-write (a live writer finishes a write in microseconds).
TORN_PEER_S = 1.0


def checkpoint(step: str) -> None:
    """A step boundary of the pipeline protocol (also the workers' PageStore ``hook``).

    Passing one is progress: the worker beats (at most every ``PROGRESS_BEAT_S``), so a
    commit writing thousands of pages, or a maintenance pass, is not taken for hung by the
    supervisor's heartbeat limit however long it runs; a worker stuck inside one step is.

    Why SIGKILL and not an exception: a crash test must see exactly what a power cut or
    OOM kill leaves behind (no ``finally``, no slot handed back, no ring record). Unlinking
    the file first makes the kill happen once, so the restarted worker runs on.
    """
    if _LIFE is not None:
        _LIFE.progress()
    if step != _KILL_AT:
        return
    try:
        os.unlink(os.environ[KILL_FILE_ENV])
    except FileNotFoundError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


class Role(IntEnum):
    """A worker's role; its value is its slot in the rank's stats block."""

    CAPTURE = 0
    COMMIT = 1
    MAINTENANCE = 2
    RESTORE = 3
    SHARE = 4  # copies durable pages to the fleet's cluster (docs/fleet.md); optional


class State(IntEnum):
    NEW = 0
    STARTING = 1  # attaching segments, opening the store, recovering
    READY = 2  # the handshake: the supervisor waits for this
    DRAINING = 3  # SIGTERM seen: finishing work in hand, taking no new work
    STOPPED = 4  # exited cleanly
    FAILED = 5  # an error ended it


TRANSITIONS: dict[State, frozenset[State]] = {
    State.NEW: frozenset({State.STARTING, State.FAILED}),
    State.STARTING: frozenset({State.READY, State.DRAINING, State.FAILED}),
    State.READY: frozenset({State.DRAINING, State.FAILED}),
    State.DRAINING: frozenset({State.STOPPED, State.FAILED}),
    State.STOPPED: frozenset(),
    State.FAILED: frozenset(),
}


class BadTransition(RuntimeError):
    pass


@dataclass(frozen=True)
class WorkerSpec:
    """What the supervisor hands a worker process (picklable for spawn)."""

    cfg: Config
    rank: int
    role: Role
    supervisor_pid: int


# Each role's module, imported in its worker process only: the supervisor, and every
# worker (spawn re-imports the CLI as __mp_main__), would otherwise load torch, which only
# capture needs and which takes ~2.5 s to import on a small host: every restart of commit
# or maintenance would pay it.
ROLE_MODULES = {
    Role.CAPTURE: "sparkcache.workers.capture",
    Role.COMMIT: "sparkcache.workers.commit",
    Role.MAINTENANCE: "sparkcache.workers.maintenance",
    Role.RESTORE: "sparkcache.workers.restore",
    Role.SHARE: "sparkcache.workers.share",
}


def run_worker(spec: WorkerSpec) -> None:
    """A worker process's entry point (the supervisor's ``Process`` target). It leaves
    with ``os._exit`` once its role returned or failed: everything that must outlive it is
    written by then (the store synced, the stats slot final), and tearing down an
    interpreter holding torch takes ~0.5 s, which every stop would pay worker by worker
    (the supervisor stops them in order)."""
    code = 0
    try:
        importlib.import_module(ROLE_MODULES[spec.role]).run(spec)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies
    (PR_SET_PDEATHSIG). Safe as a ``preexec_fn``: the forked child only calls ``prctl``."""
    if _prctl is None:
        raise OSError("PR_SET_PDEATHSIG needs Linux's prctl")
    _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def _under(supervisor_pid: int) -> bool:
    """Whether this process's parent is the supervisor (spawned) or the supervisor's fork
    server (forked): then the parent-death signal reaches it once the supervisor is gone,
    directly or through the fork server, which exits with its supervisor."""
    parent = os.getppid()
    if parent == supervisor_pid:
        return True
    try:
        return psutil.Process(parent).ppid() == supervisor_pid
    except psutil.Error:
        return False


def title(role: Role, rank: int) -> str:
    return f"sparkcache::{role.name.lower()}[r{rank}]"


class Lifecycle:
    """State machine, stop flag, heartbeat and counters of one worker process."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.state = State.NEW
        self.stop = False
        self.started = time.time()
        # What loads are addressed to, with the pid (see shm.layouts.LOAD).
        self.pid_start = process_start(os.getpid())
        self.processed = 0
        self.failed = 0
        self.backlog = 0
        self.used_bytes = 0
        self.copy_bytes = 0
        self.copy_seconds = 0.0
        self.item_errors = 0
        self.drops = dict.fromkeys(DROP_REASONS, 0)
        self._stats: StatsBlock | None = None
        self._torn_since: dict[Role, float] = {}  # peer_running: when a torn read began
        self._wake_fd = -1  # readable once a stop signal has arrived (signal wakeup fd)
        self._rare = RateLimitedLog(log)
        self.prefaulted_bytes = 0  # set by capture's prefault thread (an int store)
        self.roots_superseded = 0
        self.disk_full = 0  # items (or slices) that failed on a full filesystem
        # Items by the status they ended with, and the histogram of their durations
        # (shm.layouts.OUTCOMES, DURATION_BUCKETS_S): what the supervisor's metrics expose.
        self.outcomes = [0] * OUTCOMES
        self.dur_count = 0
        self.dur_sum_s = 0.0
        self.dur_buckets = [0] * len(DURATION_BUCKETS_S)
        # Role-specific fields of the stats record (WORKER_STATS names), the rest zero:
        # commit's lock wait, maintenance's backlog.
        self.report: dict[str, float] = {}
        self._beat_due = 0.0  # time.monotonic() after which progress() beats
        # Only this thread writes the stats slot (helper threads may pass checkpoints,
        # and a slot has one writer).
        self._thread = threading.get_ident()

    def to(self, state: State) -> None:
        if state not in TRANSITIONS[self.state]:
            raise BadTransition(f"{self.state.name} -> {state.name} is not allowed")
        log.info("%s: %s -> %s", title(self.spec.role, self.spec.rank), self.state.name,
                 state.name)
        self.state = state
        self.beat()

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stop = True  # only a flag: the loop drains and exits at its next check

    def setup(self) -> None:
        """Title, parent-death signal, signal handlers, stats slot; state STARTING."""
        spec = self.spec
        setproctitle.setproctitle(title(spec.role, spec.rank))
        # Die with the supervisor: without it a SIGKILLed supervisor leaves workers
        # attached to segments the next supervisor sweeps.
        die_with_parent()
        if not _under(spec.supervisor_pid):
            os._exit(1)  # the supervisor died before prctl took effect
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        # The C-level handler writes the signal number here, so idle() wakes at once
        # (a sleep would be resumed after the handler, PEP 475).
        self._wake_fd, wake_w = os.pipe()
        os.set_blocking(self._wake_fd, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        self._stats = segments.attach_stats(spec.cfg, spec.rank)
        global _LIFE
        _LIFE = self
        self.to(State.STARTING)
        if os.environ.get(FAULT_ROLE_ENV) != spec.role.name.lower():
            return
        fault = os.environ.get(FAULT_FILE_ENV)
        if fault and Path(fault).exists():
            log.error("%s: injected start-up crash", title(spec.role, spec.rank))
            os._exit(CRASH_EXIT)
        stall = os.environ.get(STALL_FILE_ENV)
        while stall and Path(stall).exists() and not self.stop:
            self.beat()
            self.idle(0.1)

    def peer_running(self, role: Role) -> bool:
        """Whether the process in ``role``'s stats slot of this rank is still alive (its
        pid and start time, asked of the kernel); False if the slot was never written.
        A record caught mid-write counts as running, asked again, for up to
        ``TORN_PEER_S``: one torn for longer was left so by a process killed in the
        middle of a write."""
        if self._stats is None:
            return False
        try:
            rec = self._stats.read(int(role))
        except TornRead:
            now = time.monotonic()
            since = self._torn_since.setdefault(role, now)
            return now - since < TORN_PEER_S
        self._torn_since.pop(role, None)
        return rec is not None and not process_gone(int(rec.pid), float(rec.pid_start))

    def beat(self) -> None:
        if self._stats is None:
            return
        self._beat_due = time.monotonic() + PROGRESS_BEAT_S
        values = dict.fromkeys(WORKER_STATS.dtype.names, 0)
        values.update(
            pid=os.getpid(), state=int(self.state), heartbeat=time.time(),
            started=self.started, processed=self.processed, failed=self.failed,
            item_errors=self.item_errors, backlog=self.backlog, used_bytes=self.used_bytes,
            copy_bytes=self.copy_bytes, copy_seconds=self.copy_seconds,
            prefaulted_bytes=self.prefaulted_bytes, pid_start=self.pid_start,
            roots_superseded=self.roots_superseded, disk_full=self.disk_full,
            dur_count=self.dur_count, dur_sum_s=self.dur_sum_s,
            **self.report, **{f"drop_{reason}": n for reason, n in self.drops.items()},
            **{f"outcome_{n}": c for n, c in enumerate(self.outcomes)},
            **{f"dur_le_{i}": c for i, c in enumerate(self.dur_buckets)},
        )
        self._stats.write(int(self.spec.role), WORKER_STATS.named(**values))

    def outcome(self, status: int) -> None:
        """Count an item that ended with ``status`` (a number of the role's status enum,
        ``sparkcache.protocol``); a number past the record's fields is not counted."""
        if 0 <= status < OUTCOMES:
            self.outcomes[status] += 1

    def timed(self, seconds: float) -> None:
        """Count one item's duration in the record's histogram (its bucket: the first
        bound that holds it; past the last, only the count)."""
        self.dur_count += 1
        self.dur_sum_s += seconds
        i = bisect.bisect_left(DURATION_BUCKETS_S, seconds)
        if i < len(self.dur_buckets):
            self.dur_buckets[i] += 1

    def drop(self, reason: str, what: str) -> None:
        """Count a malformed record dropped for ``reason`` (one of DROP_REASONS)."""
        self.drops[reason] += 1
        self._rare.warning(reason, "%s: dropped %s (%s)", title(self.spec.role, self.spec.rank),
                           what, reason)

    def disk_full_error(self, what: str, exc: BaseException) -> None:
        """Count ``what`` failing on a full filesystem and log it at most once a minute:
        a full disk fails every commit and slice until space returns, and logged each
        time it wrote ~1,300 lines in 15 s. The worker stays up and goes on."""
        self.disk_full += 1
        self._rare.warning("disk_full", "%s: %s failed: the store's filesystem is full "
                           "(%s); going on, %d such failures so far",
                           title(self.spec.role, self.spec.rank), what, exc, self.disk_full)

    def item_error(self, kind: str, item: object = None) -> None:
        """Count and log (with its traceback, at most once a minute per ``kind``) an
        unexpected error while handling one item (``item``: its id, for the line); the
        caller goes on with the next item. Call from an ``except`` block. The rate limit
        keeps an entry per kind: keyed by item, it grew by one per failing item for as
        long as the worker ran, and logged each with its traceback."""
        self.item_errors += 1
        what = kind if item is None else f"{kind} {item}"
        self._rare.warning(f"error:{kind}", "%s: error while handling %s; going on",
                           title(self.spec.role, self.spec.rank), what, exc_info=True)

    def progress(self) -> None:
        """Beat if the last beat is ``PROGRESS_BEAT_S`` old (a long step made progress)."""
        if time.monotonic() >= self._beat_due and threading.get_ident() == self._thread:
            self.beat()

    def serve(self, step: Callable[[float], object], poll_s: float) -> None:
        """READY: beat, then ``step(poll_s)`` (which waits at most ``poll_s`` for work),
        until a stop signal; then DRAINING, where the caller finishes what it holds."""
        self.to(State.READY)
        while not self.stop:
            self.beat()
            step(poll_s)
        self.to(State.DRAINING)

    def idle(self, seconds: float) -> None:
        """Wait up to ``seconds`` with nothing to do; return at once on a stop signal."""
        if not self.stop and self._wake_fd >= 0:
            select.select([self._wake_fd], [], [], seconds)

    def close(self) -> None:
        global _LIFE
        if _LIFE is self:
            _LIFE = None
        if self._stats is not None:
            self._stats.close()
            self._stats = None


def main(spec: WorkerSpec, body: Callable[[Lifecycle], None]) -> None:
    """Run ``body`` under a lifecycle: exit 0 after a drain, 1 after an error."""
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr,
        format=f"%(asctime)s {title(spec.role, spec.rank)} %(levelname)s %(message)s",
    )
    life = Lifecycle(spec)
    try:
        life.setup()
        body(life)
        if life.state != State.DRAINING:
            life.to(State.DRAINING)
        life.to(State.STOPPED)
    except ENVIRONMENT_FAULTS as exc:
        log.error("%s cannot run: %s", title(spec.role, spec.rank), exc)
        life.state = State.FAILED
        life.beat()
        life.close()
        sys.exit(ENV_FAULT_EXIT)
    except Exception:
        log.exception("%s failed", title(spec.role, spec.rank))
        life.state = State.FAILED
        life.beat()
        life.close()
        sys.exit(1)
    life.close()
