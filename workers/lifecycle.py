"""What every worker process shares: roles, named lifecycle states and their allowed
transitions, the readiness handshake and heartbeat (its slot of the rank's stats block),
the process title, and signal handlers that only set a flag."""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import setproctitle

from shm import StatsBlock
from sparkcache import segments
from sparkcache.config import Config

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# Test hook: a worker of role $SPARKCACHE_FAULT_ROLE exits with CRASH_EXIT at start-up
# while the file $SPARKCACHE_FAULT_FILE exists (crash-loop and fail-fast tests).
FAULT_ROLE_ENV = "SPARKCACHE_FAULT_ROLE"
FAULT_FILE_ENV = "SPARKCACHE_FAULT_FILE"
CRASH_EXIT = 3


class Role(IntEnum):
    """A worker's role; its value is its slot in the rank's stats block."""

    CAPTURE = 0
    COMMIT = 1
    MAINTENANCE = 2


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


def title(role: Role, rank: int) -> str:
    return f"sparkcache::{role.name.lower()}[r{rank}]"


class Lifecycle:
    """State machine, stop flag, heartbeat and counters of one worker process."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.state = State.NEW
        self.stop = False
        self.started = time.time()
        self.processed = 0
        self.failed = 0
        self.backlog = 0
        self.used_bytes = 0
        self.copy_bytes = 0
        self.copy_seconds = 0.0
        self._stats: StatsBlock | None = None
        self._wake_fd = -1  # readable once a stop signal has arrived (signal wakeup fd)

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
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != spec.supervisor_pid:
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
        self.to(State.STARTING)
        fault = os.environ.get(FAULT_FILE_ENV)
        if (
            fault
            and os.environ.get(FAULT_ROLE_ENV) == spec.role.name.lower()
            and Path(fault).exists()
        ):
            log.error("%s: injected start-up crash", title(spec.role, spec.rank))
            os._exit(CRASH_EXIT)

    def beat(self) -> None:
        if self._stats is None:
            return
        self._stats.write(
            int(self.spec.role),
            (
                os.getpid(), int(self.state), time.time(), self.started, self.processed,
                self.failed, self.backlog, self.used_bytes, self.copy_bytes, self.copy_seconds,
            ),
        )

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
    except Exception:
        log.exception("%s failed", title(spec.role, spec.rank))
        life.state = State.FAILED
        life.beat()
        life.close()
        sys.exit(1)
    life.close()
