"""The supervisor's view of one worker as a state machine: named states, the transitions
allowed between them, and ``tick``, the restart policy as a pure function from what the
supervisor observed to what it must do. No processes, clocks or I/O here, so a test drives
every transition without starting anything (``tests/test_supervisor_states.py``); the
supervisor (``sparkcache.supervisor``) observes, calls ``tick``, and carries out the
actions.

Policy: supervisord's ``startsecs``/``startretries``/backoff, plus the READY handshake and
a heartbeat limit.

* A worker is RUNNING only once its stats slot says READY with its own pid. A process that
  is up but has not finished starting (commit redoing slots, maintenance checking the
  index, or stuck) is not running, however long it has been up; one that is not READY
  within ``ready_timeout_s`` of its spawn, or of the last progress it reported (its
  record's ``processed`` advancing while STARTING: a check of a huge index), is killed.
  A beat alone is no progress: a worker stuck in a loop that beats is still killed.
* A failed start is an exit (or that kill) before READY, or an exit within ``startsecs`` of
  the spawn: a worker that reports READY and dies at once is crash-looping all the same.
  After ``startretries`` failed starts in a row the worker is FATAL and left down; so is
  one that exits with ``ENV_FAULT_EXIT`` (its segments or store directory are unusable),
  at once. Backoff
  before a restart doubles from ``backoff_s`` per failed start, capped at ``backoff_max_s``;
  an exit after a good start restarts after ``backoff_s`` with the count reset.
* A RUNNING worker whose heartbeat has not advanced for ``heartbeat_timeout_s`` (hung, or
  stopped with SIGSTOP) is SIGKILLed and restarted like any other exit. "Advanced" is
  judged on the supervisor's monotonic clock (when the value last changed), not by
  comparing the worker's ``time.time()`` with the supervisor's: a wall-clock step (NTP)
  must neither kill every worker at once nor hide a hang.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum

from sparkcache.workers.lifecycle import ENV_FAULT_EXIT
from sparkcache.workers.lifecycle import State as WorkerLifecycle


class WorkerState(str, Enum):
    """What the supervisor says of a worker; the values are what ``runtime.json`` and
    ``sparkcache status`` show."""

    STOPPED = "STOPPED"  # no process: not started yet, or stopped with the supervisor
    STARTING = "STARTING"  # spawned, not READY yet
    RUNNING = "RUNNING"  # READY with its own pid, heartbeat advancing
    KILLING = "KILLING"  # SIGKILLed (hung, or not READY in time); waiting for its exit
    BACKOFF = "BACKOFF"  # exited; spawned again at ``restart_at``
    FATAL = "FATAL"  # too many failed starts in a row; left down


S = WorkerState
TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    S.STOPPED: frozenset({S.STARTING}),
    # Exits go to BACKOFF, or FATAL when it was one failed start too many; exits while
    # the supervisor stops go to STOPPED.
    S.STARTING: frozenset({S.RUNNING, S.KILLING, S.BACKOFF, S.FATAL, S.STOPPED}),
    S.RUNNING: frozenset({S.KILLING, S.BACKOFF, S.FATAL, S.STOPPED}),
    S.KILLING: frozenset({S.BACKOFF, S.FATAL, S.STOPPED}),
    S.BACKOFF: frozenset({S.STARTING, S.STOPPED}),
    # Left down until the supervisor restarts; nothing brings it back.
    S.FATAL: frozenset(),
}


class BadTransition(RuntimeError):
    pass


class Action(str, Enum):
    SPAWN = "spawn"  # start a new process for the worker
    KILL = "kill"  # SIGKILL its process (it will be seen to exit)


@dataclass(frozen=True)
class Policy:
    startsecs: float = 1.0
    startretries: int = 3
    backoff_s: float = 0.25
    backoff_max_s: float = 5.0
    # As long as the supervisor waits at start-up: commit may redo a slot of several GiB
    # and maintenance reconcile a large store before they report READY.
    ready_timeout_s: float = 60.0
    heartbeat_timeout_s: float = 10.0


@dataclass(frozen=True)
class Record:
    """What a worker's stats slot says (``shm.layouts.WORKER_STATS``)."""

    pid: int
    state: int  # a ``workers.lifecycle.State``
    heartbeat: float  # the worker's time.time() at its last beat
    processed: int = 0  # its work done; while STARTING, its start-up steps (progress)


@dataclass(frozen=True)
class Observation:
    """What the supervisor saw of a worker just now."""

    pid: int | None = None  # its current process, if it has one
    exit_code: int | None = None  # set once that process has exited (negative: signal)
    record: Record | None = None  # its stats slot; None if unwritten or unreadable
    stopping: bool = False  # the supervisor is shutting down


@dataclass(frozen=True)
class WorkerView:
    """The supervisor's state of one worker; every time is its monotonic clock."""

    state: WorkerState = S.STOPPED
    started: float = 0.0  # when the current (or last) process was spawned
    ready_at: float | None = None  # when it was first seen READY; None before
    failed_starts: int = 0  # in a row
    restarts: int = 0
    restart_at: float = 0.0  # BACKOFF: when to spawn again
    last_exit: int | None = None
    backoffs: tuple[float, ...] = ()
    beat: float | None = None  # the last heartbeat value seen
    beat_at: float = 0.0  # when that value was first seen
    # STARTING: the start-up steps the worker reported done (its record's ``processed``,
    # e.g. maintenance's index check), and when they last advanced.
    progress: int = 0
    progress_at: float = 0.0

    def to(self, state: WorkerState, **changes: object) -> WorkerView:
        """This view in ``state`` (with ``changes``); refuses a transition the table does
        not allow."""
        if state not in TRANSITIONS[self.state]:
            raise BadTransition(f"{self.state.name} -> {state.name} is not allowed")
        return dataclasses.replace(self, state=state, **changes)


@dataclass(frozen=True)
class Step:
    """``tick``'s answer: the new view, what to do, and why (for the log)."""

    view: WorkerView
    actions: tuple[Action, ...] = ()
    note: str = ""


def tick(view: WorkerView, now: float, obs: Observation, policy: Policy) -> Step:
    """The next view of a worker and the actions that go with it."""
    state = view.state
    if state is S.FATAL:
        return Step(view)
    if state is S.STOPPED:
        if obs.stopping:
            return Step(view)
        return _spawn(view, now, restart=False)
    if state is S.BACKOFF:
        if obs.stopping:
            return Step(view.to(S.STOPPED))
        if now >= view.restart_at:
            return _spawn(view, now, restart=True)
        return Step(view)
    # STARTING, RUNNING, KILLING: a process exists until it is seen to exit.
    if obs.exit_code is not None:
        return _exited(view, now, obs, policy)
    if obs.stopping or state is S.KILLING:
        return Step(view)  # the supervisor's shutdown, or the kill, ends it
    # Before READY its slot may still hold its predecessor's record: only its own counts.
    rec = obs.record if obs.record is not None and obs.record.pid == obs.pid else None
    if state is S.STARTING:
        if rec is not None and rec.state == WorkerLifecycle.READY:
            return Step(
                view.to(S.RUNNING, ready_at=now, beat=rec.heartbeat, beat_at=now), (),
                f"READY after {now - view.started:.2f}s",
            )
        if rec is not None and rec.processed > view.progress:
            return Step(dataclasses.replace(view, progress=int(rec.processed), progress_at=now))
        if now - max(view.started, view.progress_at) > policy.ready_timeout_s:
            return Step(
                view.to(S.KILLING), (Action.KILL,),
                f"not READY within {policy.ready_timeout_s:g}s"
                + (f" of its last progress ({now - view.started:.0f}s after its start)"
                   if view.progress else "") + "; killed",
            )
        return Step(view)
    # RUNNING
    if rec is not None and rec.heartbeat != view.beat:
        return Step(dataclasses.replace(view, beat=rec.heartbeat, beat_at=now))
    if now - view.beat_at > policy.heartbeat_timeout_s:
        return Step(
            view.to(S.KILLING), (Action.KILL,),
            f"no heartbeat for {now - view.beat_at:.1f}s (limit "
            f"{policy.heartbeat_timeout_s:g}s): hung or stopped; killed",
        )
    return Step(view)


def _spawn(view: WorkerView, now: float, restart: bool) -> Step:
    new = view.to(
        S.STARTING, started=now, ready_at=None, beat=None, beat_at=now, progress=0,
        progress_at=now,
        restarts=view.restarts + int(restart),
    )
    return Step(new, (Action.SPAWN,))


def _exited(view: WorkerView, now: float, obs: Observation, policy: Policy) -> Step:
    code = obs.exit_code
    if obs.stopping:
        return Step(view.to(S.STOPPED, last_exit=code))
    if code == ENV_FAULT_EXIT:
        return Step(
            view.to(S.FATAL, last_exit=code),
            (),
            f"FATAL: its environment is unusable (exit code {code}; its last log line says "
            "why): a restart cannot help",
        )
    failed_start = view.ready_at is None or now - view.started < policy.startsecs
    failed = view.failed_starts + 1 if failed_start else 0
    if failed_start and failed > policy.startretries:
        return Step(
            view.to(S.FATAL, last_exit=code, failed_starts=failed),
            (),
            f"FATAL: {failed} failed starts in a row (exited before READY or within "
            f"{policy.startsecs:g}s of starting; last exit code {code})",
        )
    backoff = min(policy.backoff_max_s, policy.backoff_s * 2 ** max(0, failed - 1))
    return Step(
        view.to(
            S.BACKOFF, last_exit=code, failed_starts=failed, restart_at=now + backoff,
            backoffs=(*view.backoffs, backoff),
        ),
        (),
        f"exited with code {code}; restart in {backoff:.2f}s",
    )
