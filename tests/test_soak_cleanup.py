"""``sparkcache soak`` (the main job of ./scripts/run-demo) stopped part way, or given
what it cannot run with: whatever happens, it exits with a line, not a traceback, and
leaves no process, no /dev/shm entry and no directory of its own behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from pipeline_util import ends_with_test
from sparkcache.shm.segment import instance_entries, instance_prefix

from sparkcache.soak import run as soak_run
from sparkcache.soak.params import LANES, SoakParamError, SoakParams

REPO = Path(__file__).resolve().parent.parent
TINY = ["--duration", "30", "--conversations", "2", "--context-min", "256",
        "--context-max", "1024", "--tail-tokens", "128", "--decode-tokens", "8",
        "--max-bytes", "2MiB", "--low-watermark-bytes", "1536KiB", "--lease-seconds", "0.5",
        "--probes", "1", "--probe-tokens", "256", "--probe-decode-tokens", "16"]
ENV = {k: v for k, v in os.environ.items() if not k.startswith("SPARKCACHE_")}


def _soak(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sparkcache", "soak", "--quick", *args],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV, preexec_fn=ends_with_test())


def _ours(pid: int) -> list[psutil.Process]:
    """The soak ``pid``'s supervisors and workers (they inherit SPARKCACHE_INSTANCE
    soak<pid><lane>) and its control engine."""
    found = []
    for proc in psutil.process_iter():
        try:
            if (proc.environ().get("SPARKCACHE_INSTANCE", "").startswith(f"soak{pid}")
                    or ("sparkcache.soak.control" in proc.cmdline() and proc.ppid() == pid)):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def _left(pid: int, work: Path) -> list[str]:
    """What soak ``pid`` left: processes, /dev/shm entries, directories under ``work``."""
    left = [f"pid {p.pid}" for p in _ours(pid)]
    left += [e for i in range(len(LANES)) for e in instance_entries(f"soak{pid}{i}")]
    left += instance_entries(f"soak{pid}ctl")
    left += [p.name for p in work.iterdir() if p.name.startswith("sparkcache-soak-")]
    return left


def _sweep(pid: int) -> None:
    """Stop what a failed test left (a supervisor unlinks its segments on SIGTERM)."""
    procs = _ours(pid)
    for proc in procs:
        proc.terminate()
    psutil.wait_procs(procs, timeout=60)
    for proc in _ours(pid):
        proc.kill()
    for entry in os.listdir("/dev/shm"):
        if entry.removeprefix("sem.").startswith(instance_prefix(f"soak{pid}")[:-1]):
            os.unlink(f"/dev/shm/{entry}")


def _wait_for(what, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _settled(left, timeout: float) -> list[str]:
    """``left()`` once it is empty, or what it still holds after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (found := left()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def _store(work: Path) -> Path | None:
    found = list(work.glob("sparkcache-soak-*/isolated-read-write"))
    return found[0] if found else None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the isolated lane needs 2 cores")
@pytest.mark.parametrize(("signum", "moment"), [
    (signal.SIGTERM, "supervisor-starting"), (signal.SIGINT, "supervisor-starting"),
    (signal.SIGTERM, "soaking"), (signal.SIGINT, "soaking"), (signal.SIGINT, "soaking-twice"),
])
def test_a_soak_stopped_by_a_signal_leaves_nothing(tmp_path, signum, moment):
    """SIGTERM (kill, timeout, a cancelled CI job) or SIGINT sent to the soak's process
    alone, while a lane's supervisor starts or during the soak: the supervisor, its
    workers, the control engine, every segment and the soak's directory are gone."""
    proc = _soak("--lanes", "isolated-read-write", *TINY, "--work-dir", str(tmp_path))
    try:
        if moment == "supervisor-starting":
            # A supervisor runs and its workers are not all READY yet (no runtime.json).
            _wait_for(lambda: any("supervise" in _cmdline(p) for p in _ours(proc.pid)))
            store = _store(tmp_path)
            assert store is not None and not (store / "runtime.json").exists()
        else:
            _wait_for(lambda: (s := _store(tmp_path)) is not None
                      and (s / "runtime.json").exists())
            time.sleep(4)  # probes, aging, the soak
        proc.send_signal(signum)
        if moment == "soaking-twice":
            # The second Ctrl-C of an operator who finds the first one slow: it lands
            # while the soak waits for the lane's supervisor to drain.
            time.sleep(0.3)
            proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode != 0
        if moment == "soaking-twice":
            # Cut short: the store may still be in use as it is removed; never its
            # processes or its segments.
            left = _settled(lambda: [x for x in _left(proc.pid, tmp_path)
                                     if not x.startswith("sparkcache-soak-")], 60)
            assert not left
            return
        assert "Traceback" not in err, err[-3000:]
        assert not _settled(lambda: _left(proc.pid, tmp_path), 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        _sweep(proc.pid)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="mounts a small /dev/shm in a mount namespace of its own (root)")
def test_a_dev_shm_too_small_is_refused_before_anything_starts(tmp_path):
    """In a container's /dev/shm (64 MiB by default; 16 MiB here) the engine's KV cache
    does not fit: refused up front, naming what to change, instead of a SIGBUS that
    leaves the segment behind."""
    script = (f"mount -t tmpfs -o size=16m tmpfs /dev/shm || exit 77; "
              f"{sys.executable} -m sparkcache soak --quick --lanes off "
              f"--work-dir {tmp_path}; rc=$?; ls -A /dev/shm; exit $rc")
    result = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=REPO, env=ENV,
                            capture_output=True, text=True, timeout=180)
    if result.returncode == 77:
        pytest.skip("cannot mount a tmpfs here")
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "/dev/shm has 16.0MiB free" in result.stderr
    assert "--context-max" in result.stderr and "--shm-size" in result.stderr
    assert result.stdout.strip() == ""  # nothing left in that /dev/shm
    assert not list(tmp_path.iterdir())


def test_the_shm_check_counts_the_engine_and_the_supervisor(monkeypatch):
    params = SoakParams.quick(lanes=("off",))

    class Fs:
        f_blocks = 1 << 20
        f_frsize = 4096
        f_bavail = 0

    monkeypatch.setattr(soak_run.os, "statvfs", lambda _: Fs)
    page = 16 * 1024
    need = (soak_run.kv_blocks(params) + soak_run.control_mod.kv_blocks(params)) * page
    Fs.f_bavail = need // 4096
    soak_run._check_shm(params, 0)
    with pytest.raises(SoakParamError, match="--context-max"):
        soak_run._check_shm(params, 4096)


def _refused(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparkcache", "soak", "--quick", *args],
                          cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize(("args", "named"), [
    (["--lanes", "isolated-read-write", "--lookup-lease-seconds", "4000"],
     "--lookup-lease-seconds"),
    (["--lanes", "off", "--seed", "-1"], "--seed"),
    (["--lanes", "off,inline-read-write,off"], "off named twice"),
    (["--lanes", "off", "--work-dir", "/nonexistent/soak"], "--work-dir"),
])
def test_bad_arguments_exit_2_naming_the_flag_before_anything_starts(tmp_path, args, named):
    work = ["--work-dir", str(tmp_path)] if "--work-dir" not in args else []
    result = _refused(*TINY, "--duration", "2", *args, *work)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    line = [x for x in result.stderr.splitlines() if x.startswith("sparkcache: ")]
    assert line and named in line[0], result.stderr[-3000:]
    assert not list(tmp_path.iterdir())


def test_outputs_that_cannot_be_written_are_refused_before_the_lanes_run(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    result = _refused(*TINY, "--duration", "2", "--lanes", "off", "--work-dir",
                      str(tmp_path), "--csv-dir", str(a_file))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "--csv-dir" in result.stderr and "Traceback" not in result.stderr
    result = _refused(*TINY, "--duration", "2", "--lanes", "off", "--work-dir",
                      str(tmp_path), "--plot", str(tmp_path / "nowhere" / "soak.png"))
    if "matplotlib" not in result.stderr:  # without the extra it stops at once anyway
        assert result.returncode == 2, result.stderr[-3000:]
        assert "--plot" in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_duplicate_lanes_and_negative_seeds_are_refused():
    with pytest.raises(SoakParamError, match="expected each lane once"):
        SoakParams(lanes=("off", "off")).check()
    with pytest.raises(SoakParamError, match="--seed"):
        SoakParams(lanes=("off",), seed=-3).check()
