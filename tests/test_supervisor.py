"""The supervisor: crash loops end FATAL with backoff, start-up failures fail fast, one
supervisor per store dir, a SIGKILLed supervisor's segments are swept, pinning, a hung
(SIGSTOPped) worker is killed and restarted, a restart is RUNNING only once READY."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from multiprocessing.synchronize import Event as EventType
from pathlib import Path

import psutil
import pytest
from pipeline_util import make_cfg, runtime, start_supervisor, stop_supervisor, wait_for
from sparkcache.shm.layouts import WORKER_STATS
from sparkcache.shm.segment import Segment, SegmentSpec, instance_entries, user
from sparkcache.workers.lifecycle import (
    CRASH_EXIT,
    ENV_FAULT_EXIT,
    FAULT_FILE_ENV,
    FAULT_ROLE_ENV,
    STALL_FILE_ENV,
    Role,
    State,
)

from sparkcache import segments
from sparkcache.runtime import read, read_live
from sparkcache.supervisor import Supervisor, default_cpus
from sparkcache.supervisor_states import Policy

pytestmark = pytest.mark.slow


def _worker(store: Path, role: str) -> dict:
    return next(w for w in runtime(store)["workers"] if w["role"] == role)


def test_crash_loop_ends_fatal_and_second_supervisor_refused(
    tmp_path: Path, instance: str
) -> None:
    store, fault = tmp_path / "store", tmp_path / "crash"
    env = {FAULT_ROLE_ENV: "commit", FAULT_FILE_ENV: str(fault)}
    sup = start_supervisor(store, instance, "--startsecs", "3", "--startretries", "2", env=env)
    try:
        second = subprocess.run(
            [*_cli(), "supervise", "--store-dir", str(store), "--instance", instance + "b"],
            capture_output=True, text=True, timeout=60,
        )
        assert second.returncode == 1
        assert "another supervisor" in second.stderr
        # The same instance on a store dir (and parents) this start makes: refused, and
        # nothing of it is left behind.
        typo = tmp_path / "new" / "stroe"
        third = subprocess.run(
            [*_cli(), "supervise", "--store-dir", str(typo), "--instance", instance],
            capture_output=True, text=True, timeout=60,
        )
        assert third.returncode == 1
        assert "another supervisor of this instance runs" in third.stderr, third.stderr
        assert not (tmp_path / "new").exists()
        fault.touch()  # from now on the commit worker dies as it starts
        commit_pid = _worker(store, "commit")["pid"]
        # Killed once it has run past --startsecs (3 s): a crash of a running worker, not a
        # failed start. Commit is READY well before the supervisor, so without the wait the
        # kill can land inside startsecs.
        time.sleep(3.5)
        os.kill(commit_pid, signal.SIGKILL)
        wait_for(lambda: _worker(store, "commit")["state"] == "FATAL", 60, "commit FATAL")
        w = _worker(store, "commit")
        assert w["last_exit"] == CRASH_EXIT
        # One restart after the kill (it had run long enough), then failed starts with
        # backoff doubling between tries, then FATAL after startretries.
        assert w["backoffs"] == [0.25, 0.25, 0.5]
        assert sup.poll() is None  # the supervisor stays up
        assert _worker(store, "maintenance")["state"] == "RUNNING"
        shown = subprocess.run([*_cli(), "status", "--store-dir", str(store)],
                               capture_output=True, text=True, timeout=60)
        assert shown.returncode == 1  # and reports it
        assert shown.stdout.splitlines()[-1] == "sparkcache: FATAL: sparkcache::commit[r0]"
    finally:
        rc, err = stop_supervisor(sup)
    assert rc == 0
    assert "sparkcache::commit[r0] FATAL" in err
    assert instance_entries(instance) == []


def _cli() -> list[str]:
    return [sys.executable, "-m", "sparkcache"]


def test_start_up_failure_fails_fast_naming_the_worker(tmp_path: Path, instance: str) -> None:
    store, fault = tmp_path / "store", tmp_path / "crash"
    fault.touch()
    env = {FAULT_ROLE_ENV: "maintenance", FAULT_FILE_ENV: str(fault)}
    sup = start_supervisor(store, instance, env=env, wait_ready=False)
    try:
        _, err = sup.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        sup.kill()
        sup.communicate(timeout=10)
        pytest.fail("supervisor did not fail fast")
    rc = sup.returncode
    assert rc == 1
    assert f"sparkcache::maintenance[r0] died at start-up with exit code {CRASH_EXIT}" in err
    assert instance_entries(instance) == []
    assert not (store / "runtime.json").exists()


def _drain_on_the_second_sigterm(ready: EventType) -> None:
    """A worker that lost the first SIGTERM, as one forked moments before it came can."""
    terms: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: terms.append(signum))
    ready.set()
    while len(terms) < 2:
        time.sleep(0.01)


def _stop_forked_restore(tmp_path: Path, instance: str, target, heartbeat_s: float
                         ) -> tuple[int | None, float]:
    """Stop, as the supervisor stops the restore role, a forked stand-in for its worker
    running ``target(ready)``: its exit code and how long the stop took."""
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    proc = ctx.Process(target=target, args=(ready,))
    proc.start()
    try:
        assert ready.wait(30)
        sup = Supervisor(make_cfg(tmp_path, instance),
                         policy=Policy(heartbeat_timeout_s=heartbeat_s))
        restore = next(w for w in sup.workers if w.role is Role.RESTORE)
        restore.proc = proc
        t0 = time.monotonic()
        sup._stop_role(Role.RESTORE)
        return proc.exitcode, time.monotonic() - t0
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()


def test_a_worker_that_lost_its_sigterm_is_asked_again_not_killed(
        tmp_path: Path, instance: str) -> None:
    """The flake this fixes: a start-up failure stopped a restore worker forked a few ms
    earlier, the worker never saw the SIGTERM and served (and beat) for ever."""
    code, took = _stop_forked_restore(tmp_path, instance, _drain_on_the_second_sigterm, 60.0)
    assert code == 0  # drained and exited by itself, not killed
    assert took < 30


def _ignore_sigterm(ready: EventType) -> None:
    """A worker whose SIGTERM is ignored (a native library masking it) and which serves on."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    while True:
        time.sleep(0.01)


def test_a_worker_that_ignores_sigterm_is_killed_not_waited_for_ever(
        tmp_path: Path, instance: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """It would beat on, so the heartbeat limit would never end the stop."""
    from sparkcache import supervisor as supervisor_mod

    monkeypatch.setattr(supervisor_mod, "IGNORED_TERM_S", 1.0)
    code, took = _stop_forked_restore(tmp_path, instance, _ignore_sigterm, 3600.0)
    assert code == -signal.SIGKILL
    assert took < 600  # IGNORED_TERM_S, not the heartbeat limit (3600 s)


def test_sigkilled_supervisor_is_swept_by_the_next(tmp_path: Path, instance: str) -> None:
    store = tmp_path / "store"
    sup = start_supervisor(store, instance)
    pids = [w["pid"] for w in runtime(store)["workers"]]
    tree = [p.pid for p in psutil.Process(sup.pid).children(recursive=True)]
    assert set(pids) < set(tree)  # and the fork server of capture and restore
    sup.kill()
    sup.communicate(timeout=30)
    # Workers and the fork server die with it (PR_SET_PDEATHSIG) ...
    wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                          for p in tree), 20, "workers to die with the supervisor")
    assert instance_entries(instance)  # ... but its segments stay until the next start
    assert read_live(store) == (read(store), False)  # its runtime.json stays too: stale
    done = subprocess.run([*_cli(), "status", "--store-dir", str(store)],
                          capture_output=True, text=True, timeout=60)
    assert f"supervisor not running (runtime.json of pid {sup.pid} left" in done.stdout
    # A health probe built on status sees it: unhealthy, with the capacity it ran with.
    assert done.returncode == 1 and "healthy=no" in done.stdout, done.stdout
    assert "/1.0GiB healthy=no" in done.stdout, done.stdout  # its 1 GiB, not the default
    assert f"the supervisor (pid {sup.pid}) was killed" in done.stdout
    # What else a kill leaves: the fork server's socket directory, and a runtime file's
    # temporary copy (a kill inside its rewrite, planted here).
    old_mp = Path(read(store)["mp_temp_dir"])
    assert old_mp.is_dir() and old_mp.name.startswith("pymp-")
    temp = store / f".runtime.json.{os.urandom(8).hex()}.tmp"
    temp.write_text("{")
    old_pid = sup.pid
    sup = start_supervisor(store, instance, wait_ready=False)
    try:
        wait_for(lambda: (read(store) or {}).get("pid") == sup.pid, 90, "the new runtime.json")
        assert len(runtime(store)["workers"]) == 4 and old_pid != sup.pid
        assert not old_mp.exists() and not temp.exists()
        new_mp = Path(read(store)["mp_temp_dir"])
        assert new_mp.is_dir() and new_mp != old_mp
    finally:
        rc, _ = stop_supervisor(sup)
    assert rc == 0
    assert instance_entries(instance) == [] and not new_mp.exists()


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_store_dir_removed_or_replaced_under_it_stops_the_supervisor(
        tmp_path: Path, instance: str, how: str) -> None:
    """Its workers hold descriptors into the store they started on: before, they went on
    committing into a deleted directory, its space freed only when they exited and seen
    by no tool, while status found nothing at the path."""
    store = tmp_path / "store"
    sup = start_supervisor(store, instance)
    try:
        store.rename(tmp_path / "moved")
        if how == "replaced":
            store.mkdir(mode=0o700)
        rc = sup.wait(60)
        err = sup.stderr.read()
    finally:
        if sup.poll() is None:
            stop_supervisor(sup)
    assert rc == 1, err[-3000:]
    assert f"store dir {store} was {how}" in err
    assert "Traceback" not in err
    assert instance_entries(instance) == []  # engines see no supervisor, and serve on
    # The runtime file of the store it served is removed; nothing is written where its
    # path now leads.
    assert not (tmp_path / "moved" / "runtime.json").exists()
    assert not store.exists() or list(store.iterdir()) == []


def test_sigterm_to_the_whole_process_group_drains_every_worker(
        tmp_path: Path, instance: str) -> None:
    """A service manager stops the unit by signalling every process in it at once: the
    fork server survives it (its workers would die with it, mid-drain), each worker
    drains, and the supervisor stops cleanly. Capture is stopped (SIGSTOP) meanwhile, so
    that its drain comes only once the supervisor continues it, well after the signal."""
    store = tmp_path / "store"
    sup = start_supervisor(store, instance, new_session=True)
    tree = [p.pid for p in psutil.Process(sup.pid).children(recursive=True)]
    capture = next(w["pid"] for w in runtime(store)["workers"] if w["role"] == "capture")
    os.kill(capture, signal.SIGSTOP)
    os.killpg(sup.pid, signal.SIGTERM)
    rc, err = stop_supervisor(sup)
    assert rc == 0, err[-3000:]
    for role in ("capture", "commit", "maintenance", "restore"):
        assert f"sparkcache::{role}[r0]: DRAINING -> STOPPED" in err, role
    assert "killed" not in err
    # Commit, signalled with everyone, drained until capture (continued only by the
    # supervisor's stop) was gone: what capture handed over meanwhile was committed.
    assert (err.index("sparkcache::capture[r0]: DRAINING -> STOPPED")
            < err.index("sparkcache::commit[r0]: DRAINING -> STOPPED")), err[-3000:]
    wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                          for p in tree), 20, "every process of the supervisor to end")
    assert instance_entries(instance) == []


def test_avoid_keeps_workers_off_the_avoided_cores(tmp_path: Path, instance: str) -> None:
    if (psutil.cpu_count() or 1) < 2:
        pytest.skip("needs two cores")
    store = tmp_path / "store"
    busy = subprocess.Popen(["sleep", "120"])
    try:
        psutil.Process(busy.pid).cpu_affinity([0])
        every = list(range(psutil.cpu_count()))
        sup = start_supervisor(store, instance, "--avoid", str(busy.pid))
        try:
            # The supervisor and its fork server too.
            for p in [psutil.Process(sup.pid), *psutil.Process(sup.pid).children()]:
                assert p.cpu_affinity() == every[1:], p
            for w in runtime(store)["workers"]:
                p = psutil.Process(w["pid"])
                assert p.cpu_affinity() == every[1:] == w["cpus"], w
                assert p.nice() == (10 if w["role"] == "maintenance" else 0)
                if w["role"] == "maintenance":
                    assert tuple(p.ionice()) == (psutil.IOPRIO_CLASS_BE, 7)
                assert p.name().startswith("sparkcache::")
        finally:
            rc, _ = stop_supervisor(sup)
        assert rc == 0
    finally:
        busy.kill()
        busy.wait(10)


@pytest.mark.parametrize("start_nice,want", [(0, 10), (5, 15), (15, 19)])
def test_maintenance_is_made_nicer_than_the_supervisor_never_less_nice(
        start_nice: int, want: int) -> None:
    """Maintenance runs 10 nicer than what it inherits (at most 19), and its I/O no higher
    than best effort 7: an absolute nice 10 raised it, as root, above a supervisor run
    under nice 15; an idle I/O class stays idle."""
    from sparkcache.supervisor import _lower_priority

    def child(io_idle: bool) -> subprocess.Popen:
        def lower() -> None:
            os.nice(start_nice)
            if io_idle:
                psutil.Process().ionice(psutil.IOPRIO_CLASS_IDLE)
        return subprocess.Popen(["sleep", "60"], preexec_fn=lower)

    for io_idle in (False, True):
        proc = child(io_idle)
        try:
            p = psutil.Process(proc.pid)
            _lower_priority(p)
            assert p.nice() == want
            assert p.ionice().ioclass == (psutil.IOPRIO_CLASS_IDLE if io_idle
                                          else psutil.IOPRIO_CLASS_BE)
            if not io_idle:
                assert p.ionice().value == 7
        finally:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("mode,roles", [
    ("read-write", ["capture", "commit", "maintenance", "restore"]),
    ("restore-only", ["commit", "maintenance", "restore"]),
    ("off", ["commit", "maintenance"]),
])
def test_workers_of_each_access_mode(tmp_path: Path, instance: str, mode: str,
                                     roles: list[str]) -> None:
    """A restore worker whenever restores happen: in every mode but off."""
    sup = Supervisor(make_cfg(tmp_path, instance, access_mode=mode, ranks="2"))
    assert [(w.rank, w.role.name.lower()) for w in sup.workers] == [
        (rank, role) for rank in (0, 1) for role in roles]


def test_cpus_flag_and_default(tmp_path: Path, instance: str) -> None:
    cfg = make_cfg(tmp_path, instance, cpus="0")
    assert Supervisor(cfg).cpus == [0]
    assert default_cpus([]) == list(range(psutil.cpu_count()))
    own = psutil.Process().cpu_affinity()
    if len(own) < psutil.cpu_count():
        pytest.skip("this process is pinned already")
    assert default_cpus([os.getpid()]) == list(range(psutil.cpu_count()))  # all: warned


def _pids(store: Path) -> dict[str, int]:
    return {w["role"]: w["pid"] for w in runtime(store)["workers"]}


def test_sigstopped_worker_is_killed_and_restarted(tmp_path: Path, instance: str) -> None:
    store = tmp_path / "store"
    sup = start_supervisor(store, instance, "--heartbeat-timeout-s", "3")
    try:
        before = _pids(store)
        time.sleep(1.5)  # past --startsecs: a hang of a running worker, not a failed start
        stopped_at = time.monotonic()
        os.kill(before["commit"], signal.SIGSTOP)

        def restarted() -> bool:
            w = _worker(store, "commit")
            return w["restarts"] == 1 and w["state"] == "RUNNING"

        wait_for(restarted, 60, "the stopped commit to be killed, restarted and RUNNING")
        took = time.monotonic() - stopped_at
        w = _worker(store, "commit")
        assert w["last_exit"] == -signal.SIGKILL and w["pid"] != before["commit"]
        assert not psutil.pid_exists(before["commit"])
        assert 3 <= took < 9, took  # after the limit given, well before the default 10 s
        # READY again: its stats slot says so with the new pid (what RUNNING waits for).
        with segments.attach_stats(make_cfg(store, instance), 0) as stats:
            rec = stats.read(int(Role.COMMIT))
        assert rec[0] == w["pid"] and rec[1] == State.READY
        # The others were left alone.
        for role in ("capture", "maintenance"):
            other = _worker(store, role)
            assert (other["pid"], other["restarts"], other["state"]) == (
                before[role], 0, "RUNNING")
    finally:
        rc, err = stop_supervisor(sup)
    assert rc == 0, err[-3000:]
    assert "sparkcache::commit[r0] no heartbeat for" in err
    assert instance_entries(instance) == []


def test_restart_is_running_only_once_ready(tmp_path: Path, instance: str) -> None:
    store, stall = tmp_path / "store", tmp_path / "stall"
    env = {FAULT_ROLE_ENV: "commit", STALL_FILE_ENV: str(stall)}
    sup = start_supervisor(store, instance, "--startsecs", "0.5", env=env)
    try:
        first = _worker(store, "commit")["pid"]
        time.sleep(1.0)  # past --startsecs
        stall.touch()  # from now on a new commit stays STARTING
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: _worker(store, "commit")["restarts"] == 1, 30, "commit restarted")
        # Up for four times --startsecs, beating, but never READY: not RUNNING.
        time.sleep(2.0)
        w = _worker(store, "commit")
        assert w["state"] == "STARTING" and psutil.pid_exists(w["pid"]), w
        shown = subprocess.run([*_cli(), "status", "--store-dir", str(store)],
                               capture_output=True, text=True, timeout=60).stdout
        assert "workers=3/4 running" in shown
        stall.unlink()  # now it reports READY
        wait_for(lambda: _worker(store, "commit")["state"] == "RUNNING", 30, "commit RUNNING")
        assert _worker(store, "commit")["pid"] == w["pid"]
    finally:
        rc, err = stop_supervisor(sup)
    assert rc == 0, err[-3000:]
    assert instance_entries(instance) == []


def test_ready_timeout_bounds_the_start(tmp_path: Path, instance: str) -> None:
    """A worker that never reports READY fails the start after --ready-timeout, naming it,
    and leaves nothing running or in /dev/shm."""
    store, stall = tmp_path / "store", tmp_path / "stall"
    stall.touch()  # commit stays STARTING
    env = {FAULT_ROLE_ENV: "commit", STALL_FILE_ENV: str(stall)}
    started = time.monotonic()
    # Long enough for the other workers to start on a loaded 2-core host (they took up
    # to 9 s beside other tests), well short of the default 60 s.
    sup = start_supervisor(store, instance, "--ready-timeout", "15", env=env, wait_ready=False)
    try:
        _, err = sup.communicate(timeout=60)
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.communicate(timeout=10)
    assert sup.returncode == 1, err[-3000:]
    assert "sparkcache: sparkcache::commit[r0] not ready in 15s" in err, err[-3000:]
    assert time.monotonic() - started < 50
    assert instance_entries(instance) == []


# ------------------------------------------------------------------ refusals at start-up

def _refused(store: Path, instance: str, *extra: str) -> str:
    """Run ``supervise``; it must exit 1 within 60 s with one line and no traceback,
    having started no worker (nothing of the instance in /dev/shm, no runtime.json).
    Returns that line."""
    return _refused_env(store, instance, None, *extra)


def _refused_env(store: Path, instance: str, env: dict | None, *extra: str) -> str:
    sup = start_supervisor(store, instance, *extra, env=env, wait_ready=False)
    try:
        _, err = sup.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        sup.kill()
        sup.communicate(timeout=10)
        pytest.fail("supervisor did not refuse promptly")
    lines = err.strip().splitlines()
    assert sup.returncode == 1 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert not (store / "runtime.json").exists()
    return lines[0]


@pytest.mark.parametrize("kind", ["owner", "fifo"])
def test_foreign_segment_of_the_instance_refused_in_one_line(
    tmp_path: Path, instance: str, kind: str
) -> None:
    name = segments.name(instance, 0, segments.STATS)
    path = "/dev/shm" + name
    if kind == "owner":  # another user's segment, with a header naming a live creator
        with Segment.create(name, SegmentSpec("stats", 1), 64) as seg:
            seg.owner = False  # keep the name when this mapping closes
        os.chown(path, 65534, -1)
        what = f"{path} (owner {user(65534)}, mode 0600)"
    else:  # a FIFO: the old sweep waited on it forever
        os.mkfifo(path, 0o600)
        what = f"{path} (a FIFO, owner {user(0)})"
    try:
        line = _refused(tmp_path / "store", instance)
        assert line == (
            f"sparkcache: /dev/shm holds {what} under the names of instance {instance}, not "
            "a segment of this user's; refusing to use it: remove it (as its owner or root) "
            "or choose another --instance"
        )
        assert instance_entries(instance) == [name[1:]]  # left alone, nothing else made
    finally:
        os.unlink(path)


@pytest.mark.parametrize("kind", ["symlink", "mode", "owner"])
def test_unsafe_store_dir_refused_before_any_worker(
    tmp_path: Path, instance: str, kind: str
) -> None:
    real, store = tmp_path / "real", tmp_path / "store"
    real.mkdir(mode=0o700)
    if kind == "symlink":
        store.symlink_to(real)
        reason = "is a symlink; refusing to follow it"
    elif kind == "mode":
        store.mkdir()
        store.chmod(0o777)
        reason = "has mode 0777: writable by group or others; expected 0700"
    else:
        store.mkdir(mode=0o700)
        os.chown(store, 65534, -1)
        reason = f"is owned by uid 65534, not by this user (uid {os.geteuid()})"
    line = _refused(store, instance)
    assert line == f"sparkcache: store dir {store} {reason}"
    assert instance_entries(instance) == []
    assert not (real / "supervisor.lock").exists()


def test_lock_file_link_is_not_followed(tmp_path: Path, instance: str) -> None:
    store, victim = tmp_path / "store", tmp_path / "elsewhere" / "created"
    store.mkdir(mode=0o700)
    victim.parent.mkdir()
    (store / "supervisor.lock").symlink_to(victim)
    line = _refused(store, instance)
    assert line == f"sparkcache: {store / 'supervisor.lock'} is a symlink; refusing to use it"
    assert not victim.exists()
    assert instance_entries(instance) == []


# ------------------------------------------------------------------ memory at start-up

def test_ready_fast_with_gib_slots_prefaulted_behind_ready(tmp_path: Path, instance: str) -> None:
    """Capture reports READY before its slots are resident (it used to fault 2 x 1 GiB in
    first, which put the arena in its RSS before READY) and faults them in afterwards,
    reporting progress in its stats."""
    store, arena = tmp_path / "store", 2 * 1024**3
    t0 = time.monotonic()
    sup = start_supervisor(store, instance, "--capture-slots", "2",
                           "--capture-slot-bytes", "1GiB")
    try:
        ready_s = time.monotonic() - t0
        rss = psutil.Process(_worker(store, "capture")["pid"]).memory_info().rss
        assert rss < arena / 2, rss
        assert ready_s < 30, ready_s
        field = WORKER_STATS.dtype.names.index("prefaulted_bytes")
        with segments.attach_stats(make_cfg(store, instance), 0) as stats:
            wait_for(lambda: stats.read(int(Role.CAPTURE))[field] == arena, 120,
                  "the slots to be prefaulted")
        rss = psutil.Process(_worker(store, "capture")["pid"]).memory_info().rss
        assert rss > arena  # resident now: counted in capture's RSS (shared memory)
    finally:
        rc, err = stop_supervisor(sup)
    assert rc == 0, err[-3000:]
    assert instance_entries(instance) == []


def test_dev_shm_too_small_refused_in_one_line(tmp_path: Path, instance: str) -> None:
    vfs = os.statvfs("/dev/shm")
    free = vfs.f_bavail * vfs.f_frsize
    # Safety net for code without the check: capture exits at once instead of faulting in
    # more than /dev/shm holds.
    fault = tmp_path / "crash"
    fault.touch()
    line = _refused_env(tmp_path / "store", instance,
                        {FAULT_ROLE_ENV: "capture", FAULT_FILE_ENV: str(fault)},
                        "--capture-slots", "2", "--capture-slot-bytes", str(free))
    assert line.startswith("sparkcache: /dev/shm has "), line
    assert f"(1 rank x (2 slots x {free / 1024**3:.1f}GiB + " in line
    assert line.endswith("or a larger /dev/shm (docker run --shm-size)")
    assert instance_entries(instance) == []


def test_environment_fault_is_fatal_at_once_not_a_crash_loop(
        tmp_path: Path, instance: str) -> None:
    """A worker whose store directory has become unsafe (here: the rank's directory
    replaced by a link) exits with one line and code 4, and is FATAL at once: no restart
    could help. The other workers run on."""
    store = tmp_path / "store"
    sup = start_supervisor(store, instance)
    try:
        before = _pids(store)
        time.sleep(1.5)  # past --startsecs
        rank = store / "rank-0"
        rank.rename(store / "elsewhere")
        rank.symlink_to(store / "elsewhere")
        os.kill(before["commit"], signal.SIGKILL)
        wait_for(lambda: _worker(store, "commit")["state"] == "FATAL", 30, "commit FATAL")
        w = _worker(store, "commit")
        assert w["restarts"] == 1 and w["last_exit"] == ENV_FAULT_EXIT, w
        for role in ("capture", "maintenance"):
            assert _worker(store, role)["state"] == "RUNNING"
    finally:
        rc, err = stop_supervisor(sup)
    assert rc == 0, err[-3000:]
    lines = [ln for ln in err.splitlines() if "sparkcache::commit[r0] cannot run" in ln]
    assert len(lines) == 1 and "symlink" in lines[0], err[-3000:]
    assert "Traceback" not in err
    assert "FATAL: its environment is unusable" in err


def test_a_restart_that_cannot_be_spawned_or_recorded_stops_nothing(
        tmp_path: Path, instance: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The watch loop, driven without processes: a restart whose spawn fails (fork refused
    by a pids limit) counts as a start that failed, backed off and tried again, and a
    runtime.json that cannot be written (the store's filesystem full) is tried again at
    the next look; neither escapes the loop, which used to drain every worker and exit."""
    import dataclasses
    import errno

    from sparkcache.supervisor_states import WorkerState

    sup = Supervisor(make_cfg(tmp_path / "store", instance))
    spawns: list[str] = []

    def refused(w) -> None:
        spawns.append(w.name)
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    def full() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sup, "_spawn", refused)
    monkeypatch.setattr(sup, "write_runtime", full)
    sup._watch_once()  # every worker STOPPED: each spawned, and refused
    assert len(spawns) == len(sup.workers)
    assert all(w.state is WorkerState.BACKOFF and w.view.failed_starts == 1
               for w in sup.workers)
    assert sup._runtime_stale
    monkeypatch.setattr(sup, "write_runtime", lambda: None)
    for w in sup.workers:
        w.view = dataclasses.replace(w.view, restart_at=0.0)
    sup._watch_once()  # due again: refused again, counted again; the file written
    assert all(w.view.failed_starts == 2 for w in sup.workers)
    assert not sup._runtime_stale
