"""The supervisor's state machine, without processes: every pair of states is allowed or
refused by the table, every allowed transition is what ``tick`` does in some situation,
and the restart policy (READY handshake, heartbeat limit, startsecs/startretries, capped
backoff) holds."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from sparkcache.workers.lifecycle import ENV_FAULT_EXIT
from sparkcache.workers.lifecycle import State as Life

from sparkcache.supervisor_states import (
    TRANSITIONS,
    Action,
    BadTransition,
    Observation,
    Policy,
    Record,
    WorkerState,
    WorkerView,
    tick,
)

S = WorkerState
POLICY = Policy(startsecs=1.0, startretries=3, backoff_s=0.25, backoff_max_s=5.0,
                ready_timeout_s=60.0, heartbeat_timeout_s=10.0)
PID = 4242
T0 = 1000.0  # a monotonic time


def _view(state: WorkerState, **kw: object) -> WorkerView:
    return dataclasses.replace(WorkerView(), state=state, **kw)


def _running(**kw: object) -> WorkerView:
    base = {"started": T0, "ready_at": T0 + 0.5, "beat": 5.0, "beat_at": T0 + 0.5}
    return _view(S.RUNNING, **{**base, **kw})


def _rec(state: Life = Life.READY, heartbeat: float = 5.0, pid: int = PID) -> Record:
    return Record(pid, int(state), heartbeat)


@pytest.mark.parametrize("src,dst", list(itertools.product(S, S)))
def test_every_transition_is_allowed_or_refused(src: WorkerState, dst: WorkerState) -> None:
    view = _view(src)
    if dst in TRANSITIONS[src]:
        assert view.to(dst).state is dst
    else:
        with pytest.raises(BadTransition, match=f"{src.name} -> {dst.name}"):
            view.to(dst)


# For each allowed transition, a situation in which tick takes it: (view, now, observation).
SCENARIOS: dict[tuple[WorkerState, WorkerState], tuple[WorkerView, float, Observation]] = {
    (S.STOPPED, S.STARTING): (_view(S.STOPPED), T0, Observation()),
    (S.STARTING, S.RUNNING): (
        _view(S.STARTING, started=T0), T0 + 0.3, Observation(PID, record=_rec())),
    (S.STARTING, S.KILLING): (
        _view(S.STARTING, started=T0), T0 + 61, Observation(PID, record=_rec(Life.STARTING))),
    (S.STARTING, S.BACKOFF): (_view(S.STARTING, started=T0), T0 + 0.2, Observation(PID, 1)),
    (S.STARTING, S.FATAL): (
        _view(S.STARTING, started=T0, failed_starts=3), T0 + 0.2, Observation(PID, 1)),
    (S.STARTING, S.STOPPED): (
        _view(S.STARTING, started=T0), T0 + 0.2, Observation(PID, 0, stopping=True)),
    (S.RUNNING, S.KILLING): (_running(), T0 + 11, Observation(PID, record=_rec())),
    (S.RUNNING, S.BACKOFF): (_running(), T0 + 30, Observation(PID, -9)),
    (S.RUNNING, S.FATAL): (_running(failed_starts=3), T0 + 0.8, Observation(PID, 1)),
    (S.RUNNING, S.STOPPED): (_running(), T0 + 30, Observation(PID, 0, stopping=True)),
    (S.KILLING, S.BACKOFF): (_view(S.KILLING, started=T0, ready_at=T0 + 1), T0 + 30,
                             Observation(PID, -9)),
    (S.KILLING, S.FATAL): (_view(S.KILLING, started=T0, failed_starts=3), T0 + 61,
                           Observation(PID, -9)),
    (S.KILLING, S.STOPPED): (_view(S.KILLING, started=T0), T0 + 30,
                             Observation(PID, -9, stopping=True)),
    (S.BACKOFF, S.STARTING): (_view(S.BACKOFF, restart_at=T0), T0, Observation()),
    (S.BACKOFF, S.STOPPED): (_view(S.BACKOFF, restart_at=T0 + 5), T0,
                             Observation(stopping=True)),
}


def test_every_allowed_transition_has_a_scenario() -> None:
    allowed = {(src, dst) for src, dsts in TRANSITIONS.items() for dst in dsts}
    assert set(SCENARIOS) == allowed


@pytest.mark.parametrize("edge", list(SCENARIOS), ids=lambda e: f"{e[0].name}->{e[1].name}")
def test_tick_takes_each_transition(edge: tuple[WorkerState, WorkerState]) -> None:
    view, now, obs = SCENARIOS[edge]
    step = tick(view, now, obs, POLICY)
    assert (view.state, step.view.state) == edge
    expected = {S.STARTING: (Action.SPAWN,), S.KILLING: (Action.KILL,)}.get(edge[1], ())
    assert step.actions == expected


def test_running_only_once_ready_with_its_own_pid() -> None:
    view = tick(WorkerView(), T0, Observation(), POLICY).view
    assert view.state is S.STARTING and view.started == T0
    # Up for far longer than startsecs, still not READY: not running.
    for obs in (
        Observation(PID),  # no record yet
        Observation(PID, record=_rec(Life.STARTING)),
        Observation(PID, record=_rec(pid=PID - 1)),  # the predecessor's READY
    ):
        step = tick(view, T0 + 30, obs, POLICY)
        assert step.view == view and step.actions == ()
    step = tick(view, T0 + 30, Observation(PID, record=_rec()), POLICY)
    assert step.view.state is S.RUNNING and step.view.ready_at == T0 + 30


def test_not_ready_in_time_is_killed_and_counts_as_a_failed_start() -> None:
    view = _view(S.STARTING, started=T0)
    step = tick(view, T0 + 60.5, Observation(PID), POLICY)
    assert step.view.state is S.KILLING and step.actions == (Action.KILL,)
    # Killing does not kill again while the process lingers.
    assert tick(step.view, T0 + 70, Observation(PID), POLICY).actions == ()
    after = tick(step.view, T0 + 70, Observation(PID, -9), POLICY).view
    assert after.state is S.BACKOFF and after.failed_starts == 1 and after.last_exit == -9


def test_start_up_progress_extends_the_ready_deadline_and_a_beat_alone_does_not() -> None:
    """A maintenance worker checking a huge index reports its steps while STARTING: each
    advance gives it ``ready_timeout_s`` more. One that stops advancing, or only beats,
    is killed that long after its last progress."""
    view = tick(WorkerView(), T0, Observation(), POLICY).view
    starting = Observation(PID, record=Record(PID, int(Life.STARTING), 1.0, 0))
    for i in range(1, 5):  # 200 s of progress, a step every 50 s
        view = tick(view, T0 + 50 * i, Observation(PID, record=Record(
            PID, int(Life.STARTING), 1.0 + i, 10 * i)), POLICY).view
        assert view.state is S.STARTING and view.progress == 10 * i
    assert tick(view, T0 + 259, starting, POLICY).view.state is S.STARTING
    step = tick(view, T0 + 261, starting, POLICY)
    assert step.view.state is S.KILLING and "of its last progress" in step.note
    # Beats without progress (a loop that beats) change nothing.
    view = tick(WorkerView(), T0, Observation(), POLICY).view
    for i in range(1, 7):
        view = tick(view, T0 + 10 * i, Observation(PID, record=Record(
            PID, int(Life.STARTING), 1.0 + i, 0)), POLICY).view
    assert tick(view, T0 + 61, starting, POLICY).view.state is S.KILLING
    # The predecessor's record is no progress of this process.
    view = tick(WorkerView(), T0, Observation(), POLICY).view
    view = tick(view, T0 + 50, Observation(PID, record=Record(PID - 1, 2, 1.0, 99)), POLICY).view
    assert view.progress == 0
    assert tick(view, T0 + 61, starting, POLICY).view.state is S.KILLING


def test_heartbeat_advancing_keeps_it_running_and_a_stale_one_kills() -> None:
    view = _running()
    now = T0 + 0.5
    for i in range(1, 40):  # beats every second for 40 s: never killed
        now += 1.0
        step = tick(view, now, Observation(PID, record=_rec(heartbeat=5.0 + i)), POLICY)
        assert step.view.state is S.RUNNING and step.actions == ()
        view = step.view
    assert view.beat == 44.0 and view.beat_at == now
    # Then it stops beating (SIGSTOP, hang, or a torn record that cannot be read).
    for dt, obs in ((5.0, Observation(PID, record=_rec(heartbeat=44.0))),
                    (10.0, Observation(PID))):
        assert tick(view, now + dt, obs, POLICY).view.state is S.RUNNING
    step = tick(view, now + 10.1, Observation(PID, record=_rec(heartbeat=44.0)), POLICY)
    assert step.view.state is S.KILLING and step.actions == (Action.KILL,)
    assert "no heartbeat for 10.1s" in step.note
    # A hung worker that had started well restarts at once with its count reset.
    after = tick(step.view, now + 10.2, Observation(PID, -9), POLICY).view
    assert after.state is S.BACKOFF and after.failed_starts == 0
    assert after.restart_at == pytest.approx(now + 10.2 + 0.25)


def test_wall_clock_steps_do_not_matter() -> None:
    """Staleness is judged by when the value last changed, on the supervisor's clock: a
    heartbeat that jumps back an hour (NTP) is still a beat."""
    view = _running(beat=1_000_000.0)
    step = tick(view, T0 + 9, Observation(PID, record=_rec(heartbeat=996_400.0)), POLICY)
    assert step.view.state is S.RUNNING and step.view.beat_at == T0 + 9
    assert tick(step.view, T0 + 18, Observation(PID), POLICY).view.state is S.RUNNING


def test_crash_loop_backs_off_doubling_capped_then_fatal() -> None:
    policy = dataclasses.replace(POLICY, startretries=8)
    view, now = WorkerView(), T0
    for _ in range(8):
        view = tick(view, now, Observation(), policy).view  # spawn (or respawn)
        assert view.state is S.STARTING
        now += 0.1
        view = tick(view, now, Observation(PID, 3), policy).view  # dies before READY
        assert view.state is S.BACKOFF
        # Not respawned before its time.
        assert tick(view, view.restart_at - 0.01, Observation(), policy).view == view
        now = view.restart_at
    assert view.backoffs == (0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0)
    assert view.restarts == 7
    view = tick(view, now, Observation(), policy).view
    step = tick(view, now + 0.1, Observation(PID, 3), policy)
    assert step.view.state is S.FATAL and step.view.last_exit == 3
    assert step.note.startswith("FATAL: 9 failed starts in a row")
    # FATAL is left down, even when the supervisor stops.
    assert tick(step.view, now + 100, Observation(), policy).view.state is S.FATAL
    assert tick(step.view, now + 100, Observation(stopping=True), policy).view.state is S.FATAL


def test_startsecs_counts_a_quick_exit_after_ready_as_a_failed_start() -> None:
    # READY at once, then dead within startsecs: a failed start (it would crash-loop).
    step = tick(_running(failed_starts=1), T0 + 0.9, Observation(PID, 1), POLICY)
    assert step.view.failed_starts == 2 and step.view.backoffs == (0.5,)
    # Past startsecs: a crash of a running worker; the count starts over.
    step = tick(_running(failed_starts=1), T0 + 1.1, Observation(PID, 1), POLICY)
    assert step.view.failed_starts == 0 and step.view.backoffs == (0.25,)


def test_stopping_spawns_nothing() -> None:
    stop = Observation(stopping=True)
    assert tick(WorkerView(), T0, stop, POLICY).actions == ()
    # A live process is left to the supervisor's shutdown; no kill for staleness either.
    view = _running()
    assert tick(view, T0 + 100, Observation(PID, stopping=True), POLICY).view == view
    assert tick(_view(S.BACKOFF, restart_at=T0), T0, stop, POLICY).actions == ()


def test_an_environment_fault_is_fatal_at_once() -> None:
    """Exit code ENV_FAULT_EXIT (segments or store directory unusable) from a worker that
    had started well: FATAL at once, not a restart into a crash loop."""
    step = tick(_running(), T0 + 30, Observation(PID, ENV_FAULT_EXIT), POLICY)
    assert step.view.state is S.FATAL and step.actions == ()
    assert step.view.last_exit == ENV_FAULT_EXIT and "environment" in step.note
