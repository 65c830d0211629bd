"""Worker lifecycle states and their allowed transitions."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from sparkcache.shm import StatsBlock
from sparkcache.shm.layouts import WORKER_STATS, join_key, split_key
from sparkcache.workers import lifecycle
from sparkcache.workers.lifecycle import (
    TRANSITIONS,
    BadTransition,
    Lifecycle,
    Role,
    State,
    WorkerSpec,
    title,
)

from sparkcache import config, segments
from tests.conftest import join_or_kill


def _life(tmp_path: Path, instance: str = "x") -> Lifecycle:
    cfg = config.load(env={}, overrides={"store_dir": str(tmp_path), "instance": instance})
    return Lifecycle(WorkerSpec(cfg, 0, Role.COMMIT, os.getppid()))


def test_normal_path(tmp_path: Path) -> None:
    life = _life(tmp_path)
    for state in (State.STARTING, State.READY, State.DRAINING, State.STOPPED):
        life.to(state)
    assert life.state is State.STOPPED


def test_drain_before_ready_and_failure_anywhere(tmp_path: Path) -> None:
    life = _life(tmp_path)
    life.to(State.STARTING)
    life.to(State.DRAINING)
    life.to(State.FAILED)
    with pytest.raises(BadTransition):
        life.to(State.STARTING)


@pytest.mark.parametrize("src,dst", list(itertools.product(State, State)))
def test_every_transition_is_allowed_or_refused(tmp_path: Path, src: State, dst: State) -> None:
    life = _life(tmp_path)
    life.state = src
    if dst in TRANSITIONS[src]:
        life.to(dst)
        assert life.state is dst
    else:
        with pytest.raises(BadTransition):
            life.to(dst)
        assert life.state is src


def test_signal_only_sets_the_flag(tmp_path: Path) -> None:
    life = _life(tmp_path)
    life._on_signal(15, None)
    assert life.stop and life.state is State.NEW


def test_heartbeat_lands_in_the_role_slot(tmp_path: Path, instance: str) -> None:
    cfg = config.load(env={}, overrides={"store_dir": str(tmp_path), "instance": instance})
    block = StatsBlock.create(segments.name(instance, 0, segments.STATS), WORKER_STATS, 3)
    try:
        life = Lifecycle(WorkerSpec(cfg, 0, Role.MAINTENANCE, os.getppid()))
        life._stats = StatsBlock.attach(block.name, WORKER_STATS)
        life.to(State.STARTING)
        rec = block.read(int(Role.MAINTENANCE))
        assert rec[0] == os.getpid() and rec[1] == State.STARTING
        life.close()
    finally:
        block.close()


def test_checkpoints_beat_while_a_long_step_makes_progress(
    tmp_path: Path, instance: str
) -> None:
    """A step that runs for seconds but passes checkpoints (a commit writing many pages)
    keeps its heartbeat fresh for the supervisor; other threads never write the slot."""
    cfg = config.load(env={}, overrides={"store_dir": str(tmp_path), "instance": instance})
    block = StatsBlock.create(segments.name(instance, 0, segments.STATS), WORKER_STATS, 3)
    life = Lifecycle(WorkerSpec(cfg, 0, Role.COMMIT, os.getppid()))
    try:
        life._stats = StatsBlock.attach(block.name, WORKER_STATS)
        lifecycle._LIFE = life
        life.to(State.STARTING)
        first = block.read(int(Role.COMMIT))[2]
        beats = set()
        for _ in range(12):  # 1.2 s of "work", a checkpoint every 0.1 s
            time.sleep(0.1)
            lifecycle.checkpoint("commit.temp_write")
            beats.add(block.read(int(Role.COMMIT))[2])
        assert len(beats - {first}) >= 2
        last = block.read(int(Role.COMMIT))[2]
        time.sleep(lifecycle.PROGRESS_BEAT_S + 0.1)
        other = threading.Thread(target=lifecycle.checkpoint, args=("commit.fsync",))
        other.start()
        other.join()
        assert block.read(int(Role.COMMIT))[2] == last
    finally:
        life.close()
        assert lifecycle._LIFE is None
        block.close()


def test_title_and_key_halves() -> None:
    assert title(Role.CAPTURE, 3) == "sparkcache::capture[r3]"
    key = "00112233445566778899aabbccddeeff"
    assert join_key(*split_key(key)) == key


def _idle_until_stopped(cfg: config.Config, parent: int, out) -> None:
    life = Lifecycle(WorkerSpec(cfg, 0, Role.MAINTENANCE, parent))
    life.setup()
    out.put("ready")
    t0 = time.monotonic()
    life.idle(60)
    out.put((life.stop, time.monotonic() - t0))
    life.close()


def test_idle_returns_when_a_stop_signal_arrives(tmp_path: Path, instance: str, spawn) -> None:
    cfg = config.load(env={}, overrides={"store_dir": str(tmp_path), "instance": instance})
    block = StatsBlock.create(segments.name(instance, 0, segments.STATS), WORKER_STATS, 3)
    out = spawn.Queue()
    child = spawn.Process(target=_idle_until_stopped, args=(cfg, os.getpid(), out))
    try:
        child.start()
        assert out.get(timeout=60) == "ready"
        time.sleep(0.2)  # let it enter the wait
        os.kill(child.pid, signal.SIGTERM)
        stopped, waited = out.get(timeout=60)
        assert stopped and waited < 30  # woken by the signal, not by the 60 s timeout
        assert join_or_kill(child) == 0
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        block.close()


def test_every_role_has_a_stats_slot() -> None:
    assert [int(r) for r in Role] == list(range(segments.STATS_SLOTS))
