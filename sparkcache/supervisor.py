"""``sparkcache supervise``: owns every shared-memory segment of an instance, starts the
capture, commit, maintenance and restore workers of each rank, pins them, watches them
through their process sentinels and restarts them with backoff.

Each worker's state and restart policy (supervisord's ``startsecs``/``startretries``
and backoff, the READY handshake, the heartbeat limit) are the state machine of
``sparkcache.supervisor_states``; this module only observes processes and stats slots,
feeds ``tick`` and carries out what it returns (spawn, kill).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import multiprocessing as mp
import os
import signal
import stat
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path

import posix_ipc
import psutil

from sparkcache import __version__, activity, runtime, segments
from sparkcache.activity import Activity
from sparkcache.config import AccessMode, Config
from sparkcache.filesystems import MEMORY_FILESYSTEMS, filesystem_of
from sparkcache.metrics import reading
from sparkcache.metrics.carry import Carry
from sparkcache.metrics.reading import Source, WorkerInfo
from sparkcache.metrics.server import MetricsServer, MetricsServerError
from sparkcache.ratelog import RateLimitedLog
from sparkcache.runtime import RUNTIME_FILE, RUNTIME_SETTINGS
from sparkcache.shm import SegmentError, TornRead, sweep
from sparkcache.shm.segment import (
    SHM_DIR,
    foreign_entries,
    instance_entries,
    process_start,
    read_creator,
    user,
)
from sparkcache.sizing import size
from sparkcache.store import StoreError, UnsafeStoreDir, layout
from sparkcache.store.space import space_of
from sparkcache.supervisor_states import (
    Action,
    Observation,
    Policy,
    Record,
    Step,
    WorkerState,
    WorkerView,
    tick,
)
from sparkcache.workers.lifecycle import Role, State, WorkerSpec, run_worker, title

log = logging.getLogger(__name__)

LOCK_FILE = "supervisor.lock"
# Maintenance runs this much nicer than the supervisor, never less nice: an absolute 10
# raised it, as root, above a supervisor run under `nice 19`.
MAINTENANCE_NICE_STEP = 10
MAX_NICE = 19
# Maintenance's I/O: best effort at the lowest level, not the idle class. An idle-class
# request waits while any other is pending (mq-deadline ages it after 10 s): at the cap,
# where commits write all the time, maintenance's fsync then held the index's write lock
# for up to a second, commits queued behind it, and reclaim fell behind until
# publications were refused (docs/maintenance.md). Its budget, duty and I/O caps bound
# what it asks of the disk instead.
MAINTENANCE_IOPRIO = 7
# Forked from one fork server that imported torch once (workers/forkserver.py); the others
# are spawned, and never carry torch.
FORKED_ROLES = frozenset({Role.CAPTURE, Role.RESTORE})
FORKSERVER_MODULE = "sparkcache.workers.forkserver"
WATCH_S = 0.5  # longest wait between looks at the workers (heartbeats, READY)
STARTING_WATCH_S = 0.1  # ... while one is starting, so READY shows soon
# How often a worker that has not begun to drain is sent SIGTERM again (_stop_role). The
# handler only sets a flag, and every blocking wait in a worker resumes after it.
RESEND_TERM_S = 1.0
# A worker that has not begun to drain this long after the first SIGTERM ignores it (a
# native library masking it, say) and is killed: it beats on, so the heartbeat limit
# would never end the stop. A worker shows DRAINING once its current step returns, and
# the longest steps that beat last a minute (a restore worker making a CUDA context,
# SLOW_OPEN_S; a chunk read, STUCK_READ_S): this is well past them.
IGNORED_TERM_S = 90.0

__all__ = ["Policy", "Supervisor", "SupervisorError", "Worker", "default_cpus"]


class SupervisorError(RuntimeError):
    """Start-up failed: another supervisor holds the store dir, or a worker died."""


@dataclass
class Worker:
    rank: int
    role: Role
    cpus: list[int]
    proc: mp.process.BaseProcess | None = None
    view: WorkerView = field(default_factory=WorkerView)
    # Counter totals of its exited processes, so metrics stay monotonic across restarts.
    carry: Carry = field(default_factory=Carry)

    @property
    def name(self) -> str:
        return title(self.role, self.rank)

    @property
    def state(self) -> WorkerState:
        return self.view.state


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


def _lower_priority(p: psutil.Process) -> None:
    """Maintenance's CPU and I/O priority, lowered from what it inherited, never raised:
    ``MAINTENANCE_NICE_STEP`` nicer (at most 19), and best-effort I/O at level
    ``MAINTENANCE_IOPRIO`` unless it was already lower (a higher level, or the idle
    class)."""
    p.nice(min(MAX_NICE, p.nice() + MAINTENANCE_NICE_STEP))
    with contextlib.suppress(psutil.Error, AttributeError):
        cls, level = p.ionice()
        if cls == psutil.IOPRIO_CLASS_IDLE or (cls == psutil.IOPRIO_CLASS_BE
                                               and level >= MAINTENANCE_IOPRIO):
            return
        p.ionice(psutil.IOPRIO_CLASS_BE, MAINTENANCE_IOPRIO)


class Supervisor:
    def __init__(self, cfg: Config, *, avoid: list[int] | None = None,
                 policy: Policy | None = None) -> None:
        self.cfg = cfg
        self.policy = policy or Policy(heartbeat_timeout_s=cfg.heartbeat_timeout_s)
        self.cpus = list(cfg.cpus) if cfg.cpus else default_cpus(avoid or [])
        roles = [Role.COMMIT, Role.MAINTENANCE]
        if cfg.access_mode is AccessMode.READ_WRITE:
            roles.insert(0, Role.CAPTURE)
        if cfg.access_mode is not AccessMode.OFF:
            roles.append(Role.RESTORE)
        if cfg.share_cluster_url:
            roles.append(Role.SHARE)
        self.workers = [Worker(r, role, self.cpus) for r in range(cfg.ranks) for role in roles]
        self.segments: list[segments.RankSegments] = []
        self.stop = False
        self._spawn_ctx = mp.get_context("spawn")
        self._fork_ctx = mp.get_context("forkserver")
        self._fork_ctx.set_forkserver_preload([FORKSERVER_MODULE])
        self._lock_fd: int | None = None
        self._wake_r, self._wake_w = os.pipe()
        self.metrics: MetricsServer | None = None
        self._runtime_stale = False  # runtime.json could not be written: try again
        self._rare = RateLimitedLog(log)
        # Restores and hits over the last minute, for status and top (activity.json).
        self.activity = Activity(time.time(), process_start(os.getpid()))
        self._activity_at = 0.0
        # What the metrics endpoint and the activity samples read: the segments it owns
        # and its workers, as they are at each reading.
        self.source = Source(cfg, lambda: tuple(self.segments), self.worker_infos)
        self._store_fd: int | None = None  # the store dir locked, open
        self.exit_code = 0

    # ------------------------------------------------------------------ start-up

    def _lock(self) -> None:
        """Check (and create) the store dir, then take ``supervisor.lock`` in it: opened
        relative to the checked dir, never through a link. Any problem is one line."""
        store, path = self.cfg.store_dir, self.cfg.store_dir / LOCK_FILE
        try:
            dir_fd = layout.open_store_dir(store, create=True)
        except UnsafeStoreDir as exc:
            raise SupervisorError(str(exc)) from None
        except OSError as exc:
            raise SupervisorError(f"store dir {store}: {exc.strerror}") from None
        try:
            fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | layout.FILE_FLAGS, 0o600,
                         dir_fd=dir_fd)
        except OSError as exc:
            os.close(dir_fd)
            what = "a symlink" if exc.errno == errno.ELOOP else exc.strerror
            raise SupervisorError(f"{path} is {what}; refusing to use it") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise SupervisorError(
                    f"{path} is not a plain file of this user's (owner {user(st.st_uid)}); "
                    "refusing to use it"
                )
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            os.close(dir_fd)
            raise SupervisorError(
                f"another supervisor holds {path}; refusing to start"
            ) from None
        except BaseException:
            os.close(fd)
            os.close(dir_fd)
            raise
        self._lock_fd = fd
        # Kept open: the store it locked, wherever its path leads later (_check_store_dir).
        self._store_fd = dir_fd

    def _check_disk(self) -> None:
        """Say when the store's filesystem cannot hold every rank at its hard cap plus
        the free-space reserve: the store then works, bounded by the reserve rather than
        by its caps, and other users of the disk meet a full one first."""
        cfg = self.cfg
        wanted = cfg.ranks * cfg.hard_cap_bytes + cfg.min_free_bytes
        total = space_of(self._store_fd).total_bytes
        if wanted > total:
            log.warning("the store dir's filesystem holds %s; %d rank(s) at the hard cap "
                        "(%s each) plus the free space kept (%s) need %s: the disk fills "
                        "first, and the free space kept (SPARKCACHE_MIN_FREE_BYTES) bounds "
                        "the store, not SPARKCACHE_MAX_BYTES", size(total), cfg.ranks,
                        size(cfg.hard_cap_bytes), size(cfg.min_free_bytes), size(wanted))

    def _check_shm(self) -> None:
        """After the sweep, nothing of this instance may be left in /dev/shm: what is left
        belongs to another user (refused: never attach to it, and O_CREX would fail) or to
        a live supervisor of the same instance on another store dir."""
        inst = self.cfg.instance
        foreign = foreign_entries(inst)
        if foreign:
            more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
            raise SupervisorError(
                f"/dev/shm holds {foreign[0]}{more} under the names of instance {inst}, "
                "not a segment of this user's; refusing to use it: remove it (as its owner "
                "or root) or choose another --instance"
            )
        # A running engine's own segments are not a supervisor's: a supervisor started
        # (or restarted) under a running engine serves it.
        left = [e for e in instance_entries(inst) if not segments.is_engine_segment(e)]
        if left:
            creator = read_creator(SHM_DIR / left[0])
            who = f" of pid {creator[0]}" if creator else ""
            raise SupervisorError(
                f"/dev/shm already holds {len(left)} entries of instance {inst} (e.g. "
                f"{SHM_DIR / left[0]}{who}, still running): another supervisor of this "
                "instance runs; stop it or choose another --instance"
            )

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stop = True  # only a flag (and a wake-up byte); the loop does the work
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _spawn(self, w: Worker) -> None:
        spec = WorkerSpec(self.cfg, w.rank, w.role, os.getpid())
        ctx = self._fork_ctx if w.role in FORKED_ROLES else self._spawn_ctx
        proc = ctx.Process(target=run_worker, args=(spec,), name=w.name)
        proc.start()
        w.proc = proc
        try:
            p = psutil.Process(proc.pid)
            p.cpu_affinity(w.cpus)
            if w.role in (Role.MAINTENANCE, Role.SHARE):
                _lower_priority(p)
        except (psutil.Error, OSError, ValueError) as exc:
            log.warning("%s: could not pin or renice: %s", w.name, exc)
        log.info("%s started: pid %d, cores %s", w.name, proc.pid, w.cpus)

    def _observe(self, w: Worker) -> Observation:
        """What ``tick`` needs: the process (exited?) and the worker's stats slot."""
        if w.proc is None:
            return Observation(stopping=self.stop)
        exit_code = None
        if not w.proc.is_alive():
            w.proc.join(1)
            exit_code = w.proc.exitcode
        rec = self._record(w)
        record = None if rec is None else Record(int(rec.pid), int(rec.state),
                                                 float(rec.heartbeat), int(rec.processed))
        return Observation(w.proc.pid, exit_code, record, self.stop)

    def _tick(self, w: Worker, obs: Observation | None = None) -> Step:
        """Observe ``w`` (unless given what was seen), run the state machine, log why its
        state changed and carry out the actions."""
        obs = obs if obs is not None else self._observe(w)
        old = w.view
        step = tick(old, time.monotonic(), obs, self.policy)
        if obs.exit_code is not None:
            self._carry_totals(w, obs.pid)
            w.proc = None
        w.view = step.view
        if step.note:
            level = {
                WorkerState.FATAL: logging.ERROR, WorkerState.KILLING: logging.WARNING,
                WorkerState.BACKOFF: logging.WARNING,
            }.get(step.view.state, logging.INFO)
            log.log(level, "%s %s", w.name, step.note)
        for action in step.actions:
            if action is Action.SPAWN:
                self._spawn(w)
            elif action is Action.KILL and w.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.proc.pid, signal.SIGKILL)
        return step

    def _carry_totals(self, w: Worker, pid: int | None) -> None:
        """Fold the last record of ``w``'s exited process ``pid`` into its carry. The slot
        still holds it: the next process is spawned only after this tick."""
        if pid is None or w.rank >= len(self.segments):
            return
        try:
            rec = self.segments[w.rank].stats.read(int(w.role))
        except TornRead:
            return  # killed in the middle of a write: its totals since its last one are lost
        if rec is not None and int(rec.pid) == pid:
            w.carry.fold(rec)

    # ------------------------------------------------------------------ metrics

    def worker_infos(self) -> list[WorkerInfo]:
        """What the metrics endpoint reads of the workers (from its own thread: each
        field is read once, and every one is replaced whole by this thread)."""
        infos = []
        for w in self.workers:
            proc, view = w.proc, w.view
            infos.append(WorkerInfo(
                rank=w.rank, role=w.role.name.lower(), slot=int(w.role), name=w.name,
                state=view.state.value, pid=proc.pid if proc is not None else None,
                restarts=view.restarts, last_exit=view.last_exit, carry=w.carry,
            ))
        return infos

    def _start_metrics(self) -> None:
        """Listen on the metrics host and port (none when the port is 0). A port that is
        taken fails the start in one line, as any other bad setting does."""
        if self.cfg.metrics_port == 0:
            return
        server = MetricsServer(self.source)
        try:
            server.start()
        except MetricsServerError as exc:
            raise SupervisorError(str(exc)) from None
        self.metrics = server

    def _metrics_address(self) -> dict | None:
        if self.metrics is None:
            return None
        host, port = self.metrics.address
        return {"host": host, "port": port}

    @staticmethod
    def _shown(view: WorkerView) -> tuple:
        return view.state, view.restarts, view.last_exit

    def start(self) -> None:
        """Lock, sweep, create segments, start every worker and wait for each to be
        ready. Raises SupervisorError naming the worker (and exit code) that died."""
        # Handlers first: a SIGTERM during start-up must still unlink what was created.
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        made = [d for d in (self.cfg.store_dir, *self.cfg.store_dir.parents)
                if not os.path.lexists(d)]
        self._lock()
        try:
            self._start_locked()
        except BaseException:
            self.shutdown()
            self._remove_if_empty(made)
            raise

    def _remove_if_empty(self, made: list[Path]) -> None:
        """Remove the store dir and the parents this start made (``made``, the store dir
        first), if a refused start left nothing in them but the lock: a typo in
        --store-dir must not leave directories behind."""
        if not made or made[0] != self.cfg.store_dir:
            return
        try:
            if os.listdir(made[0]) != [LOCK_FILE]:
                return
            os.unlink(made[0] / LOCK_FILE)
            for d in made:
                os.rmdir(d)  # fails on one something else has put into meanwhile
        except OSError as exc:
            log.debug("store dir %s left: %s", made[0], exc)

    def _start_locked(self) -> None:
        runtime.remove_leftovers(self._store_fd, runtime.read(self.cfg.store_dir))
        self._check_disk()
        fstype = filesystem_of(self.cfg.store_dir)
        if fstype in MEMORY_FILESYSTEMS:
            log.warning("the store dir %s is on %s: the store lives in memory (up to %d "
                        "bytes a rank, beside /dev/shm's segments) and a reboot empties it",
                        self.cfg.store_dir, fstype, self.cfg.max_bytes)
        try:
            sweep(self.cfg.instance)
            self._check_shm()
            try:
                segments.check_shm_space(self.cfg)
            except segments.ShmSpaceError as exc:
                raise SupervisorError(str(exc)) from None
            try:
                for rank in range(self.cfg.ranks):
                    self.segments.append(
                        segments.RankSegments.create(self.cfg, rank, len(Role))
                    )
            except SegmentError as exc:  # a name taken since _check_shm: one line too
                raise SupervisorError(str(exc)) from None
            except posix_ipc.ExistentialError:  # the same, for a ring's semaphore
                what = "; ".join(foreign_entries(self.cfg.instance)) or "made since the sweep"
                raise SupervisorError(
                    f"a semaphore of instance {self.cfg.instance} already exists: {what}"
                ) from None
            # The supervisor's own work (watching, /metrics) and the fork server it starts
            # stay off the engine's cores too, not only the workers.
            try:
                os.sched_setaffinity(0, self.cpus)
            except OSError as exc:
                log.warning("could not pin the supervisor to cores %s: %s", self.cpus, exc)
            # Before the workers: /healthz answers 503 while they start.
            self._start_metrics()
            # Spawned ones first: starting the first forked one waits for the fork
            # server to import torch, while they start beside it.
            for w in sorted(self.workers, key=lambda w: w.role in FORKED_ROLES):
                self._tick(w)  # STOPPED -> STARTING: spawned
            # Unlike a restart, a worker that fails to start now fails the whole start:
            # it will most likely fail again, and the operator is watching.
            while starting := [w for w in self.workers if w.state is WorkerState.STARTING]:
                if self.stop:
                    raise SupervisorError("stopped by a signal during start-up")
                for w in starting:
                    obs = self._observe(w)
                    if obs.exit_code is not None:
                        raise SupervisorError(
                            f"{w.name} died at start-up with exit code {obs.exit_code}"
                        )
                    if self._tick(w, obs).view.state is WorkerState.KILLING:
                        raise SupervisorError(
                            f"{w.name} not ready in {self.policy.ready_timeout_s:g}s"
                        )
                time.sleep(0.02)
            self.write_runtime()
            runtime.write_settings(self._store_fd, self.runtime()["settings"])
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ watching

    def run(self) -> int:
        """Watch until SIGTERM/SIGINT, or until the store dir is gone; then drain and
        clean up. Returns the exit code: 1 if the store dir went."""
        try:
            while not self.stop:
                self._watch_once()
                self._check_store_dir()
        finally:
            self.shutdown()
        return self.exit_code

    def _store_dir_gone(self) -> str | None:
        """How the store dir's path no longer leads to the store this supervisor locked:
        "removed" or "replaced by another directory"; None while it does (or cannot be
        told: a permission changed, nothing to act on)."""
        if self._store_fd is None:
            return None  # not locked yet
        try:
            now = os.stat(self.cfg.store_dir, follow_symlinks=False)
            locked = os.fstat(self._store_fd)
        except FileNotFoundError:
            return "removed"
        except OSError:
            return None
        if (now.st_dev, now.st_ino) == (locked.st_dev, locked.st_ino):
            return None
        return "replaced by another directory"

    def _check_store_dir(self) -> None:
        """Stop if the store dir this supervisor locked was removed, or replaced by
        another (a cleaner of /tmp, a mistaken rm -rf, a restore from backup). Its
        workers hold descriptors into the old one: commits would go on filling a deleted
        directory, its space freed only when they exit and seen by no tool, while status
        and a new supervisor looked at the path and found nothing. Stopping unlinks the
        segments, so engines serve on without the cache, and says why."""
        what = self._store_dir_gone()
        if what is None:
            return
        log.error("store dir %s was %s while this supervisor ran; stopping (its workers "
                  "could only write into the old one): start a supervisor on the store "
                  "to be served", self.cfg.store_dir, what)
        self.exit_code = 1
        self.stop = True

    def _watch_once(self) -> None:
        """Wait for an exit, a signal, a due restart or the next look; then tick every
        worker once."""
        live = [w.proc.sentinel for w in self.workers if w.proc is not None]
        now = time.monotonic()
        longest = WATCH_S
        if any(w.state is WorkerState.STARTING for w in self.workers):
            longest = STARTING_WATCH_S
        due = [w.view.restart_at - now for w in self.workers
               if w.state is WorkerState.BACKOFF]
        ready = wait([*live, self._wake_r], max(0.0, min([longest, *due])))
        if self._wake_r in ready:
            os.read(self._wake_r, 64)
        if self.stop:
            return  # shutdown() stops the processes and ticks them to STOPPED
        changed = False
        for w in self.workers:
            old = self._shown(w.view)
            try:
                self._tick(w)
            except Exception as exc:
                if w.proc is not None:
                    raise  # not a spawn that failed: a process runs, and nothing knows why
                # A restart that could not be spawned (fork refused by a pids limit, no
                # memory): as a process that died at once, backed off and tried again,
                # not the end of every other worker.
                log.error("%s could not be started: %r", w.name, exc)
                self._tick(w, Observation(exit_code=1, stopping=self.stop))
            changed |= self._shown(w.view) != old
        if now >= self._activity_at:
            self._activity_at = now + activity.SAMPLE_S
            self._sample_activity()
        if changed or self._runtime_stale:
            try:
                self.write_runtime()
                self._runtime_stale = False
            except (OSError, StoreError) as exc:
                # The tools' view of the instance, not the instance: a full or read-only
                # store filesystem must not stop the workers.
                self._runtime_stale = True
                self._rare.warning("runtime", "could not write %s: %s; the workers go on",
                                   RUNTIME_FILE, exc)

    def _sample_activity(self) -> None:
        """Sample the engines' and restore workers' counters into ``activity.json``."""
        try:
            rd = reading.read(self.source)
            self.activity.sample(activity.read_counters(rd), rd.at)
            if self._store_fd is not None:
                activity.write(self._store_fd, self.activity.summary(rd.at))
        except (OSError, StoreError, SegmentError, TornRead) as exc:
            self._rare.warning("activity", "could not write %s: %s; the workers go on",
                               runtime.ACTIVITY_FILE, exc)

    # ------------------------------------------------------------------ runtime file

    def runtime(self) -> dict:
        """What ``runtime.json`` says (see ``sparkcache.runtime``)."""
        return {
            # Which release runs: an engine or a tool of another one reads it (status).
            "version": __version__,
            "instance": self.cfg.instance,
            "ranks": self.cfg.ranks,
            "pid": os.getpid(),
            # With the pid, tells this process from a later one that reuses the pid.
            "pid_start": process_start(os.getpid()),
            # Engines refuse to connect from another one (runtime.check_namespace).
            "pid_namespace": runtime.pid_namespace(),
            "boottime_offset": runtime.boottime_offset(),
            "cpus": self.cpus,
            # The engine side refuses publications past this: the supervisor's settings
            # are the ones enforced, whatever the engine's own environment says.
            "hard_cap_bytes": self.cfg.hard_cap_bytes,
            # The capacity settings enforced, for the tools that read a running instance
            # (status, top, sizing) rather than their own environment.
            "settings": {name: getattr(self.cfg, name) for name in RUNTIME_SETTINGS},
            # Where tools find /metrics and /healthz: the port bound (none when off).
            "metrics": self._metrics_address(),
            # What the next supervisor removes if this one is SIGKILLed.
            "mp_temp_dir": runtime.mp_temp_dir(),
            "workers": [
                {
                    "name": w.name, "rank": w.rank, "role": w.role.name.lower(),
                    "pid": w.proc.pid if w.proc is not None else None,
                    "state": w.state.value, "restarts": w.view.restarts,
                    "last_exit": w.view.last_exit, "cpus": w.cpus,
                    "backoffs": list(w.view.backoffs),
                }
                for w in self.workers
            ],
        }

    def write_runtime(self) -> None:
        runtime.write(self.cfg.store_dir, self.runtime())

    # ------------------------------------------------------------------ shutdown

    def _stop_role(self, role: Role) -> None:
        workers = [w for w in self.workers if w.role is role and w.proc is not None]
        asked: dict[int, float] = {}  # pid -> when SIGTERM was last sent
        first = time.monotonic()
        for w in workers:
            self._ask_to_stop(w)
            asked[w.proc.pid] = first
        beats: dict[int, tuple[float | None, float]] = {}  # pid -> (heartbeat, seen at)
        while True:
            left = [w for w in workers if w.proc.is_alive()]
            if not left:
                return
            now = time.monotonic()
            for w in left:
                rec = self._record(w)
                beat = None if rec is None else float(rec.heartbeat)
                last = beats.get(w.proc.pid)
                if last is None or beat != last[0]:
                    beats[w.proc.pid] = (beat, now)
                elif now - last[1] > self.policy.heartbeat_timeout_s:
                    log.warning("%s stopped making progress while draining (no heartbeat "
                                "for %.1fs); killed", w.name, now - last[1])
                    w.proc.kill()
                    w.proc.join(5)
                    continue
                # A worker forked moments ago can lose the SIGTERM: one that arrives
                # before CPython's after-fork code has run is cleared by it (it drops the
                # signals tripped "before the fork"). Such a worker would serve, and
                # beat, for ever. Until its slot shows the drain, ask again.
                draining = rec is not None and rec.pid == w.proc.pid and (
                    rec.state >= State.DRAINING)
                if not draining and now - first >= IGNORED_TERM_S:
                    log.warning("%s has not begun to drain %.0fs after SIGTERM; killed",
                                w.name, now - first)
                    w.proc.kill()
                    w.proc.join(5)
                    continue
                if (not draining
                        and now - asked[w.proc.pid] >= RESEND_TERM_S):
                    log.info("%s has not started draining; SIGTERM sent again", w.name)
                    self._ask_to_stop(w)
                    asked[w.proc.pid] = now
            time.sleep(0.05)

    @staticmethod
    def _ask_to_stop(w: Worker) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(w.proc.pid, signal.SIGTERM)
            # A stopped (SIGSTOP) worker acts on SIGTERM only once continued: let it
            # drain now rather than be killed.
            os.kill(w.proc.pid, signal.SIGCONT)

    def _record(self, w: Worker) -> tuple | None:
        """``w``'s stats record (possibly its last process's), or None: none written
        yet, or caught mid-write (stopped or killed in the middle of a write)."""
        if w.rank >= len(self.segments):
            return None
        try:
            return self.segments[w.rank].stats.read(int(w.role))
        except TornRead:
            return None

    def shutdown(self) -> None:
        """Stop the workers role by role (restore, which answers the loads queued, then
        capture, commit, maintenance: what capture hands over while it drains is still
        committed), each drained until it exits; a worker is killed only once its
        heartbeat has not advanced for the heartbeat limit (it beats while it makes
        progress), or it has not begun to drain IGNORED_TERM_S after the first SIGTERM.
        Then unlink every segment, remove the runtime file, release the lock.
        Idempotent."""
        self.stop = True
        for role in (Role.SHARE, Role.RESTORE, Role.CAPTURE, Role.COMMIT, Role.MAINTENANCE):
            self._stop_role(role)
        for w in self.workers:
            if w.proc is None or w.proc.exitcode is not None:
                self._tick(w)  # exited, or in BACKOFF: STOPPED
        # The endpoint reads the segments: it stops before they are unlinked.
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        segs, self.segments = self.segments, []
        for seg in segs:
            seg.close()
        # From the store it served, wherever that is now: not from another at its path.
        if self._store_fd is not None:
            for name in (RUNTIME_FILE, runtime.ACTIVITY_FILE):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=self._store_fd)
            os.close(self._store_fd)
            self._store_fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
