"""``status`` and ``fsck`` operator commands."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from pipeline_util import make_cfg, pipeline, wait_committed
from sparkcache.shm.layouts import WORKER_STATS
from sparkcache.shm.segment import process_start
from typer.testing import CliRunner

from sparkcache import runtime
from sparkcache.cli import app
from sparkcache.cli.store_commands import RankStatus, _rank_status, fsck_command, status
from sparkcache.config import GiB
from sparkcache.instance import NoSupervisor, running
from sparkcache.segments import RankSegments
from sparkcache.store import PageStore
from sparkcache.store.objects import HEADER_SIZE
from sparkcache.store.testing import make_root
from sparkcache.synthetic import sequences

SIZE = 1 << 20


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    store_dir = tmp_path / "store"
    for rank in (0, 1):
        with PageStore(store_dir, rank) as store:
            for _ in range(3):
                keys = [secrets.token_hex(16) for _ in range(2)]
                store.commit(make_root(secrets.token_hex(16), keys, SIZE))
    return store_dir


def test_status_line(store_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert status(store_dir, json_out=False) == 0
    # (Without those naming other tests' supervisors, running beside this one.)
    line, sup = [x for x in capsys.readouterr().out.strip().splitlines()
                 if not x.startswith("sparkcache: a supervisor (pid ")]
    assert line == "sparkcache: capacity ranks=2 entries=6 used=0.0/80.0GiB healthy=yes"
    assert sup == "sparkcache: supervisor not running"
    assert re.fullmatch(
        r"sparkcache: capacity ranks=\d+ entries=\d+ used=\d+\.\d/\d+\.\dGiB healthy=(yes|no)",
        line,
    )


def test_status_json_and_over_capacity(store_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert status(store_dir, json_out=True, max_bytes=4 * SIZE) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ranks"] == 2 and data["entries"] == 6 and data["healthy"] is False
    assert data["used_bytes"] == 12 * SIZE and data["capacity_bytes"] == 8 * SIZE


def test_status_of_a_missing_store_is_unhealthy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert status(tmp_path / "nope", json_out=False) == 1
    assert capsys.readouterr().out.splitlines()[0].endswith("healthy=no")


def _runtime_file(store_dir: Path, pid: int, started: float, state: str = "RUNNING",
                  **more: object) -> None:
    runtime.write(store_dir, {
        **more, "instance": "t", "ranks": 1, "pid": pid, "pid_start": started, "cpus": [1],
        "workers": [
            {"name": "sparkcache::capture[r0]", "rank": 0, "role": "capture", "pid": pid,
             "state": state, "restarts": 4, "last_exit": -9, "cpus": [1], "backoffs": []},
            {"name": "sparkcache::commit[r0]", "rank": 0, "role": "commit", "pid": pid,
             "state": "RUNNING", "restarts": 0, "last_exit": None, "cpus": [1], "backoffs": []},
        ],
    })


def test_status_shows_a_running_supervisor_and_its_workers(
    store_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    me = psutil.Process()
    _runtime_file(store_dir, me.pid, process_start(me.pid))
    assert status(store_dir, json_out=False) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == (f"sparkcache: supervisor pid={me.pid} instance=t workers=2/2 running "
                        "cores=[1]")
    assert lines[2].split() == ["sparkcache::capture[r0]", "RUNNING", f"pid={me.pid}",
                                "restarts=4", "last_exit=-9"]
    assert status(store_dir, json_out=True) == 0
    assert json.loads(capsys.readouterr().out)["supervisor"]["state"] == "running"
    # Its release, once runtime.json names one (one that predates it wrote none).
    _runtime_file(store_dir, me.pid, process_start(me.pid), version="0.1.0")
    assert status(store_dir, json_out=False) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith(
        f"sparkcache: supervisor pid={me.pid} version=0.1.0 instance=t ")


def test_status_fails_on_a_fatal_worker(store_dir: Path, capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    me = psutil.Process()
    _runtime_file(store_dir, me.pid, process_start(me.pid), state="FATAL")
    assert status(store_dir, json_out=False) == 1
    out = capsys.readouterr().out
    assert "healthy=no" in out and "workers=1/2 running" in out
    assert out.splitlines()[-1] == "sparkcache: FATAL: sparkcache::capture[r0]"


def test_status_sees_through_a_stale_runtime_file(
    store_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A SIGKILLed supervisor leaves runtime.json: its pid is gone, or reused by a process
    that started at another time."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    me = psutil.Process()
    for pid, started in ((gone.pid, 1.0), (me.pid, process_start(me.pid) - 100)):
        _runtime_file(store_dir, pid, started, settings={"max_bytes": 1 << 30})
        # Unhealthy: a probe built on status must notice (it said healthy=yes and exited
        # 0, with the 40 GiB default as the capacity).
        assert status(store_dir, json_out=False) == 1
        out = capsys.readouterr().out.splitlines()
        assert out[0].endswith("/2.0GiB healthy=no"), out[0]  # its 1 GiB a rank, 2 ranks
        assert out[1] == (
            f"sparkcache: supervisor not running (runtime.json of pid {pid} left by a "
            "supervisor that was killed; the next start replaces it)"
        )
        assert out[-1] == (f"sparkcache: the supervisor (pid {pid}) was killed: nothing is "
                           "served from this store until one starts again")


def test_fsck_clean_then_finds_and_repairs_damage(
    store_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert fsck_command(store_dir, json_out=True, repair=False) == 0
    assert json.loads(capsys.readouterr().out) == {
        "ok": True,
        "roots": 6,
        "objects": 12,
        "quarantined": 0,
        "pooled_files": 0,
        "pooled_bytes": 0,
        "unpunched_bytes": 0,
        "problems": [],
    }
    victim = sorted((store_dir / "rank-1" / "objects").rglob("*.*"))[0]
    data = bytearray(victim.read_bytes())
    data[HEADER_SIZE + 10] ^= 0x80  # in its first record's page (a pack's padding is no
    # page's: no checksum covers it, nor needs to)
    victim.write_bytes(data)
    orphan = victim.with_name(victim.parent.name + "0" * 30 + "." + "0" * 16)
    orphan.write_bytes(b"old")
    assert fsck_command(store_dir, json_out=True, repair=False, grace_seconds=0) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert any("checksum mismatch" in p for p in report["problems"])
    assert any("orphan file" in p for p in report["problems"])
    assert fsck_command(store_dir, json_out=False, repair=True, grace_seconds=0) == 0
    assert "quarantined=1" in capsys.readouterr().out
    assert not orphan.exists()


def test_fsck_reports_refcount_drift(store_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with PageStore(store_dir, 0) as store, store._wconn as conn:
        conn.execute("UPDATE objects SET refcount = refcount + 1")
    assert fsck_command(store_dir, json_out=False, repair=False) == 1
    assert "refcount 2 != 1 references" in capsys.readouterr().out


def test_cli_commands(store_dir: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(
        app, ["status", "--store-dir", str(store_dir), "--max-bytes", "1GiB",
              "--low-watermark-bytes", "512MiB"]
    )
    assert result.exit_code == 0 and "ranks=2 entries=6" in result.output
    assert "/2.0GiB" in result.output
    result = runner.invoke(app, ["status", "--store-dir", str(store_dir), "--max-bytes", "1GB"])
    assert result.exit_code == 2 and "SPARKCACHE_MAX_BYTES (--max-bytes)='1GB'" in result.output
    result = runner.invoke(app, ["fsck", "--store-dir", str(store_dir), "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["ok"] is True


def test_status_shows_each_ranks_maintenance_backlog(
    store_dir: Path, instance: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = make_cfg(store_dir, instance)
    segs = RankSegments.create(cfg, 0, 4)
    try:
        now = time.time()
        values = dict.fromkeys(WORKER_STATS.dtype.names, 0)
        values.update(pid=1, state=2, used_bytes=3 * GiB, backlog=GiB, episode_since=now - 7,
                      selected_roots=2, selected_bytes=5 << 20, evicted_roots=660,
                      reclaimed_bytes=8 * GiB, slice_last_s=0.003, slice_max_s=0.0182,
                      duty=0.04, refusing_since=0, refused_s=30, leased_roots=40,
                      leased_bytes=2 * GiB, yielded_roots=12, yielded_bytes=3 << 20,
                      free_bytes=9 * GiB, disk_full=2)
        segs.stats.write(2, WORKER_STATS.named(**values))
        values.update(lock_wait_s=0.5, lock_wait_max_s=0.0121)
        segs.stats.write(1, WORKER_STATS.named(**values))
        me = psutil.Process()
        runtime.write(store_dir, {"instance": instance, "ranks": 1, "pid": me.pid,
                                  "pid_start": process_start(me.pid), "cpus": [0], "workers": []})
        assert status(store_dir, json_out=False) == 0
        line = capsys.readouterr().out.splitlines()[-1].split()
        assert line[0] == "maintenance[r0]" and "used=3.0GiB" in line
        assert {"above_low=1.0GiB", "episode=7s", "selected=2/5.0MiB", "evicted=660",
                "reclaimed=8.0GiB", "slice=3.0/18.2ms", "duty=4%",
                "commit_lock_wait_max=12.1ms", "refusing=no", "refused=30s",
                "leased=40/2.0GiB", "yielded=12/3.0MiB", "disk_free=9.0GiB",
                "disk_full=2"} <= set(line)
        assert status(store_dir, json_out=True) == 0
        (report,) = json.loads(capsys.readouterr().out)["maintenance"]
        assert report["evicted_roots"] == 660 and report["commit_lock_wait_s"] == 0.5
    finally:
        segs.close()


def test_status_says_why_a_rank_has_no_report(
    store_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    me = psutil.Process()
    _runtime_file(store_dir, me.pid, process_start(me.pid))  # instance t: no segments
    assert status(store_dir, json_out=False) == 0
    assert capsys.readouterr().out.splitlines()[-1].split()[:3] == [
        "maintenance[r0]", "no", "report"]


@pytest.mark.slow
def test_status_reads_live_figures_from_a_running_instance(tmp_path: Path,
                                                           instance: str) -> None:
    """With a supervisor running: entries and used bytes are maintenance's live figures
    (the same as the index once it has caught up), capacity is the supervisor's
    max_bytes (not the caller's default), healthy is /healthz's verdict, and the metrics
    address is shown."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = tmp_path / "store"
    cli = [sys.executable, "-m", "sparkcache", "status", "--store-dir", str(store)]

    def shown(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*cli, *args], capture_output=True, text=True, timeout=60)

    with pipeline(store, instance, {"metrics_port": str(port)}) as engine:
        for sid, tokens in list(sequences(4).items())[:3]:
            assert engine.publish(sid, tokens), engine.client.counters
        engine.drain()
        assert wait_committed(engine, settle=3) == {}
        index_view = store_cli_rank(store)

        def caught_up() -> bool:
            data = json.loads(shown("--json").stdout)
            (rank,) = data["per_rank"]
            return (rank["source"] == "live" and rank["entries"] == index_view.entries
                    and rank["used_bytes"] == index_view.used_bytes)

        deadline = time.monotonic() + 20
        while not caught_up():
            assert time.monotonic() < deadline, "maintenance's figures never matched"
            time.sleep(0.3)
        out = shown()
        assert out.returncode == 0, out.stdout + out.stderr
        lines = out.stdout.splitlines()
        used = index_view.used_bytes / GiB
        assert lines[0] == (f"sparkcache: capacity ranks=1 entries={index_view.entries} "
                            f"used={used:.1f}/1.0GiB healthy=yes")
        assert (f"sparkcache: metrics http://127.0.0.1:{port}/metrics and "
                f"http://127.0.0.1:{port}/healthz") in lines
        assert "sparkcache: health ok: 4 workers READY with a fresh heartbeat" in lines
        data = json.loads(shown("--json").stdout)
        assert data["live"] is True and data["healthy"] is True
        assert data["capacity_bytes"] == GiB and data["metrics_url"].endswith(f":{port}")

        # Commit stopped: /healthz would say 503, and so does status.
        commit = next(w["pid"] for w in runtime.read(store)["workers"]
                      if w["role"] == "commit")
        os.kill(commit, signal.SIGSTOP)
        try:
            time.sleep(2.5)
            out = shown()
        finally:
            os.kill(commit, signal.SIGCONT)
        assert out.returncode == 1
        lines = out.stdout.splitlines()
        assert lines[0].endswith("healthy=no"), lines
        assert "sparkcache: health not ok (/healthz would answer 503):" in lines
        assert any(line.startswith("  sparkcache::commit[r0]: no heartbeat for")
                   for line in lines), lines
        deadline = time.monotonic() + 20
        while shown().returncode != 0:
            assert time.monotonic() < deadline, "status never healthy again"
            time.sleep(0.3)
    # Stopped: the index again, and the capacity the supervisor ran with, which it kept
    # in the store (not the tool's default of 40 GiB, nor its own flags).
    out = shown("--max-bytes", "2GiB", "--low-watermark-bytes", "1GiB")
    assert out.stdout.splitlines()[0] == (
        f"sparkcache: capacity ranks=1 entries={index_view.entries} "
        f"used={index_view.used_bytes / GiB:.1f}/1.0GiB healthy=yes")


def store_cli_rank(store: Path) -> RankStatus:
    return _rank_status(store, 0, GiB)


@pytest.mark.parametrize("damage", ["absent", "unsafe", "corrupt_rank", "no_ranks"])
def test_status_says_why_it_is_unhealthy(
    store_dir: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """healthy=no always comes with the reason on the text output too, not only in --json:
    a store dir that is missing or not safe, a rank whose index cannot be read, no ranks."""
    if damage == "absent":
        store_dir = store_dir.parent / "nope"
        why = f"no store at {store_dir}: nothing was ever stored there"
    elif damage == "unsafe":
        store_dir.chmod(0o777)
        why = "writable by group or others"
    elif damage == "corrupt_rank":
        index = store_dir / "rank-1" / "index.sqlite"
        for f in index.parent.glob("index.sqlite-*"):
            f.unlink()
        index.write_bytes(b"garbage" * 1000)
        why = "rank 1: index"
    else:
        store_dir = store_dir.parent / "empty"
        store_dir.mkdir(mode=0o700)
        why = "no ranks"
    assert status(store_dir, json_out=False) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("healthy=no")
    assert why in out, out


def test_status_of_a_runtime_file_that_is_no_object(
    store_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A runtime.json that parses but is not an object is no supervisor's: not a
    traceback."""
    (store_dir / "runtime.json").write_text("[1, 2]")
    assert status(store_dir, json_out=False) == 0
    assert capsys.readouterr().out.splitlines()[1] == "sparkcache: supervisor not running"


def test_status_shows_no_backlog_of_a_dead_maintenance_process(
    store_dir: Path, instance: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The slot still holds the last record of a maintenance process that died: its
    backlog and episode are not shown as if current (the metrics do the same)."""
    cfg = make_cfg(store_dir, instance)
    segs = RankSegments.create(cfg, 0, 4)
    try:
        values = dict.fromkeys(WORKER_STATS.dtype.names, 0)
        values.update(pid=4242, state=2, used_bytes=3 * GiB, backlog=GiB,
                      episode_since=time.time() - 7)
        segs.stats.write(2, WORKER_STATS.named(**values))
        me = psutil.Process()
        runtime.write(store_dir, {
            "instance": instance, "ranks": 1, "pid": me.pid, "pid_start": process_start(me.pid),
            "cpus": [0], "workers": [
                {"name": "sparkcache::maintenance[r0]", "rank": 0, "role": "maintenance",
                 "pid": None, "state": "BACKOFF", "restarts": 1, "last_exit": -9,
                 "cpus": [0], "backoffs": []}]})
        status(store_dir, json_out=False)
        line = capsys.readouterr().out.splitlines()[-1]
        assert line.split()[:3] == ["maintenance[r0]", "no", "report"], line
        assert "used=" not in line and "state BACKOFF" in line, line
        status(store_dir, json_out=True)
        (report,) = json.loads(capsys.readouterr().out)["maintenance"]
        assert "used_bytes" not in report and "error" in report
    finally:
        segs.close()


@pytest.mark.parametrize("grace", ["-1", "nan", "inf"])
def test_fsck_refuses_a_grace_that_is_no_age(store_dir: Path, grace: str) -> None:
    """A negative grace spares nothing a commit is writing (--repair would sweep it); nan
    and inf would never flag anything. Refused naming the flag and what is allowed."""
    result = CliRunner().invoke(app, ["fsck", "--store-dir", str(store_dir), "--repair",
                                      "--grace-seconds", grace])
    assert result.exit_code == 2, result.output
    assert f"--grace-seconds={float(grace)}: expected seconds of at least 0" in result.output


def test_fsck_repair_beside_a_running_supervisor_keeps_the_default_grace(
        store_dir: Path) -> None:
    """A running commit's file is renamed into place before a row names it: a repair with
    a shorter grace could remove it, so with a live supervisor it is refused, naming it;
    the check alone, and a repair with the default grace, still run."""
    me = psutil.Process()
    _runtime_file(store_dir, me.pid, process_start(me.pid))
    args = ["fsck", "--store-dir", str(store_dir)]
    result = CliRunner().invoke(app, [*args, "--repair", "--grace-seconds", "0"])
    assert result.exit_code == 2, result.output
    assert f"a supervisor (pid {me.pid}) is running on {store_dir}" in result.output
    assert CliRunner().invoke(app, [*args, "--grace-seconds", "0"]).exit_code == 0
    assert CliRunner().invoke(app, [*args, "--repair"]).exit_code == 0


def test_a_supervisor_in_another_namespace_is_neither_running_nor_stale_here(
        store_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Its pid means nothing in this namespace. status called it killed (the pid was gone
    here, or another process's) and fsck then let a repair with no grace sweep files its
    commits were writing; top and the demo said no supervisor ran."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _runtime_file(store_dir, gone.pid, 1.0, pid_namespace="pid:[1]")
    status(store_dir, json_out=False)
    line = capsys.readouterr().out.splitlines()[1]
    assert line.startswith("sparkcache: supervisor state unknown here: the supervisor "
                           f"(pid {gone.pid}) runs in PID namespace pid:[1]")
    assert "--pid=host" in line
    args = ["fsck", "--store-dir", str(store_dir)]
    result = CliRunner().invoke(app, [*args, "--repair", "--grace-seconds", "0"])
    assert result.exit_code == 2, result.output
    assert f"a supervisor (pid {gone.pid}) may be running (in another namespace)" \
        in result.output
    assert CliRunner().invoke(app, [*args, "--grace-seconds", "0"]).exit_code == 0
    with pytest.raises(NoSupervisor, match=r"cannot watch the supervisor .* PID namespace"):
        running(store_dir)
