"""``sparkcache supervise``: owns every shared-memory segment of an instance, starts the
capture, commit and maintenance workers of each rank, pins them, watches them through
their process sentinels and restarts them with backoff.

Restart policy (supervisord's ``startsecs``/``startretries``): a worker that exits
within ``startsecs`` of starting failed to start; after ``startretries`` such failures
in a row it is FATAL and left down (the supervisor stays up and reports it). One that ran
longer is restarted with the backoff reset. Backoff doubles from ``BACKOFF_S`` per failed
start, capped at ``BACKOFF_MAX_S``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait

import psutil

from shm import sweep
from sparkcache import runtime, segments
from sparkcache.config import AccessMode, Config
from sparkcache.runtime import RUNTIME_FILE
from workers.lifecycle import Role, State, WorkerSpec, run_worker, title

log = logging.getLogger(__name__)

LOCK_FILE = "supervisor.lock"
READY_TIMEOUT_S = 60.0
STOP_DEADLINE_S = 10.0
BACKOFF_S = 0.25
BACKOFF_MAX_S = 5.0
MAINTENANCE_NICE = 10



class SupervisorError(RuntimeError):
    """Start-up failed: another supervisor holds the store dir, or a worker died."""


@dataclass
class Policy:
    startsecs: float = 1.0
    startretries: int = 3


@dataclass
class Worker:
    rank: int
    role: Role
    cpus: list[int]
    proc: mp.process.BaseProcess | None = None
    started: float = 0.0
    state: str = "STOPPED"  # STARTING, RUNNING, BACKOFF, FATAL, STOPPED
    failed_starts: int = 0
    restarts: int = 0
    restart_at: float = 0.0
    last_exit: int | None = None
    backoffs: list[float] = field(default_factory=list)

    @property
    def name(self) -> str:
        return title(self.role, self.rank)


def default_cpus(avoid: list[int]) -> list[int]:
    """Every core the processes ``avoid`` may not run on; all cores if that is none."""
    every = list(range(psutil.cpu_count(logical=True) or 1))
    taken: set[int] = set()
    for pid in avoid:
        try:
            taken.update(psutil.Process(pid).cpu_affinity())
        except psutil.Error as exc:
            log.warning("--avoid %d: %s; ignored", pid, exc)
    left = [c for c in every if c not in taken]
    if not left:
        log.warning("the avoided processes may use every core; workers run anywhere")
        return every
    return left


class Supervisor:
    def __init__(self, cfg: Config, *, avoid: list[int] | None = None,
                 policy: Policy | None = None) -> None:
        self.cfg = cfg
        self.policy = policy or Policy()
        self.cpus = list(cfg.cpus) if cfg.cpus else default_cpus(avoid or [])
        roles = [Role.COMMIT, Role.MAINTENANCE]
        if cfg.access_mode is AccessMode.READ_WRITE:
            roles.insert(0, Role.CAPTURE)
        self.workers = [Worker(r, role, self.cpus) for r in range(cfg.ranks) for role in roles]
        self.segments: list[segments.RankSegments] = []
        self.stop = False
        self._ctx = mp.get_context("spawn")
        self._lock_fd: int | None = None
        self._wake_r, self._wake_w = os.pipe()

    # ------------------------------------------------------------------ start-up

    def _lock(self) -> None:
        self.cfg.store_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.cfg.store_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SupervisorError(
                f"another supervisor holds {self.cfg.store_dir / LOCK_FILE}; refusing to start"
            ) from None
        self._lock_fd = fd

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stop = True  # only a flag (and a wake-up byte); the loop does the work
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _spawn(self, w: Worker) -> None:
        spec = WorkerSpec(self.cfg, w.rank, w.role, os.getpid())
        proc = self._ctx.Process(target=run_worker, args=(spec,), name=w.name)
        proc.start()
        w.proc, w.started, w.state = proc, time.monotonic(), "STARTING"
        try:
            p = psutil.Process(proc.pid)
            p.cpu_affinity(w.cpus)
            if w.role is Role.MAINTENANCE:
                p.nice(MAINTENANCE_NICE)
                with contextlib.suppress(psutil.Error, AttributeError):
                    p.ionice(psutil.IOPRIO_CLASS_IDLE)
        except psutil.Error as exc:
            log.warning("%s: could not pin or renice: %s", w.name, exc)
        log.info("%s started: pid %d, cores %s", w.name, proc.pid, w.cpus)

    def _ready(self, w: Worker) -> bool:
        rec = self.segments[w.rank].stats.read(int(w.role))
        return rec is not None and rec[0] == w.proc.pid and rec[1] == State.READY

    def start(self) -> None:
        """Lock, sweep, create segments, start every worker and wait for each to be
        ready. Raises SupervisorError naming the worker (and exit code) that died."""
        # Handlers first: a SIGTERM during start-up must still unlink what was created.
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self._lock()
        try:
            sweep(self.cfg.instance)
            for rank in range(self.cfg.ranks):
                self.segments.append(segments.RankSegments.create(self.cfg, rank, len(Role)))
            for w in self.workers:
                self._spawn(w)
            deadline = time.monotonic() + READY_TIMEOUT_S
            for w in self.workers:
                while not self._ready(w):
                    if self.stop:
                        raise SupervisorError("stopped by a signal during start-up")
                    if not w.proc.is_alive():
                        raise SupervisorError(
                            f"{w.name} died at start-up with exit code {w.proc.exitcode}"
                        )
                    if time.monotonic() > deadline:
                        raise SupervisorError(f"{w.name} not ready in {READY_TIMEOUT_S}s")
                    time.sleep(0.02)
                w.state = "RUNNING"
            self.write_runtime()
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ watching

    def run(self) -> int:
        """Watch until SIGTERM/SIGINT; then drain and clean up. Returns the exit code."""
        try:
            while not self.stop:
                self._watch_once()
        finally:
            self.shutdown()
        return 0

    def _watch_once(self) -> None:
        live = {w.proc.sentinel: w for w in self.workers if w.proc is not None}
        now = time.monotonic()
        due = [w.restart_at - now for w in self.workers if w.state == "BACKOFF"]
        timeout = max(0.0, min([0.5, *due]))
        ready = wait([*live, self._wake_r], timeout)
        changed = False
        for s in ready:
            if s == self._wake_r:
                os.read(self._wake_r, 64)
            else:
                self._exited(live[s])
                changed = True
        now = time.monotonic()
        for w in self.workers:
            if w.state == "STARTING" and now - w.started >= self.policy.startsecs:
                w.state, w.failed_starts = "RUNNING", 0
                changed = True
            if w.state == "BACKOFF" and now >= w.restart_at and not self.stop:
                self._spawn(w)
                w.restarts += 1
                changed = True
        if changed:
            self.write_runtime()

    def _exited(self, w: Worker) -> None:
        w.proc.join(1)
        w.last_exit = w.proc.exitcode
        quick = time.monotonic() - w.started < self.policy.startsecs
        w.proc = None
        if self.stop:
            w.state = "STOPPED"
            return
        w.failed_starts = w.failed_starts + 1 if quick else 0
        if quick and w.failed_starts > self.policy.startretries:
            w.state = "FATAL"
            log.error("%s FATAL: exited %d times within %.1fs of starting (last exit code %s)",
                      w.name, w.failed_starts, self.policy.startsecs, w.last_exit)
            return
        backoff = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** max(0, w.failed_starts - 1))
        w.state, w.restart_at = "BACKOFF", time.monotonic() + backoff
        w.backoffs.append(backoff)
        log.warning("%s exited with code %s; restart in %.2fs", w.name, w.last_exit, backoff)

    # ------------------------------------------------------------------ runtime file

    def runtime(self) -> dict:
        """What ``runtime.json`` says (see ``sparkcache.runtime``)."""
        return {
            "instance": self.cfg.instance,
            "ranks": self.cfg.ranks,
            "pid": os.getpid(),
            # With the pid, tells this process from a later one that reuses the pid.
            "started": psutil.Process().create_time(),
            "cpus": self.cpus,
            "workers": [
                {
                    "name": w.name, "rank": w.rank, "role": w.role.name.lower(),
                    "pid": w.proc.pid if w.proc is not None else None, "state": w.state,
                    "restarts": w.restarts, "last_exit": w.last_exit, "cpus": w.cpus,
                    "backoffs": w.backoffs,
                }
                for w in self.workers
            ],
        }

    def write_runtime(self) -> None:
        runtime.write(self.cfg.store_dir, self.runtime())

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """SIGTERM every worker (they drain), kill what outlives the deadline, unlink
        every segment, remove the runtime file, release the lock. Idempotent."""
        self.stop = True
        procs = [w.proc for w in self.workers if w.proc is not None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_DEADLINE_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                log.warning("%s outlived the stop deadline; killed", p.name)
                p.kill()
                p.join(5)
        for w in self.workers:
            if w.proc is not None:
                w.last_exit, w.proc, w.state = w.proc.exitcode, None, "STOPPED"
        for seg in self.segments:
            seg.close()
        self.segments = []
        with contextlib.suppress(FileNotFoundError):
            (self.cfg.store_dir / RUNTIME_FILE).unlink()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
