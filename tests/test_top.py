"""``sparkcache top`` against a real supervisor: ``--once`` and ``--json`` show every worker
with its pid and state and each rank's figures; a worker SIGKILLed shows as restarting,
then with its new pid once the supervisor has restarted it; no supervisor is one clear
line and exit 1. Also the pure parts: sorting and the used-bytes bar."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from pipeline_util import SETTINGS, pipeline, runtime, wait_committed, wait_for
from sparkcache.workers.lifecycle import FAULT_ROLE_ENV, STALL_FILE_ENV

from sparkcache.synthetic import sequences
from sparkcache.top.gather import Frame, ProcessFigures, WorkerRow, sort_workers
from sparkcache.top.render import bar, header

ROLES = ("capture", "commit", "maintenance", "restore")
# Each check runs `sparkcache top` in a new interpreter: not more than 5 a second.
_wait = functools.partial(wait_for, poll=0.2)


def top(store: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sparkcache", "top", "--store-dir", str(store), *args],
        capture_output=True, text=True, timeout=timeout,
    )


def top_json(store: Path) -> dict:
    out = top(store, "--json", "--interval", "0.2")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _by_role(frame: dict) -> dict[str, dict]:
    return {w["role"]: w for w in frame["workers"]}


@pytest.mark.slow
def test_top_follows_a_running_instance_through_a_restart(tmp_path: Path,
                                                          instance: str) -> None:
    store, stall = tmp_path / "store", tmp_path / "stall"
    # While ``stall`` exists a new commit process stays STARTING: the restart is visible.
    env = {FAULT_ROLE_ENV: "commit", STALL_FILE_ENV: str(stall)}
    with pipeline(store, instance, env=env) as engine:
        seqs = dict(list(sequences(4).items())[:3])
        for sid, tokens in seqs.items():
            assert engine.publish(sid, tokens), engine.client.counters
        engine.drain()
        assert wait_committed(engine, settle=3) == {}
        pids = {w["role"]: w["pid"] for w in runtime(store)["workers"]}

        # --once: one line per worker with its pid and state, then the rank's line.
        out = top(store, "--once", "--interval", "0.5")
        assert out.returncode == 0, out.stderr
        text = out.stdout
        assert f"instance {instance}" in text and "health ok" in text
        lines = text.splitlines()
        for role in ROLES:
            (row,) = [line.split() for line in lines if line.startswith(role + " ")]
            assert row[1] == "0" and row[2] == str(pids[role]), row
            assert "RUNNING" in row, row
        assert any(line.split()[:2] == ["0", f"{SETTINGS['capture_slots']}/0/0"]
                   for line in lines), text  # rank 0: every capture slot free

        # --json: the same data, figures included.
        frame = top_json(store)
        assert frame["instance"] == instance and frame["healthy"] is True
        workers = _by_role(frame)
        assert set(workers) == set(ROLES)
        for role, w in workers.items():
            assert w["pid"] == pids[role] and w["state"] == "RUNNING" and w["up"], w
            assert w["report_state"] == "READY" and 0 <= w["heartbeat_age_s"] < 2
            p = w["process"]
            assert p["rss_bytes"] > 0 and p["cores"] and p["cpu_percent"] is not None
            assert p["ctx_switches"] > 0 and p["ctx_switches_per_s"] is not None
        (rank,) = frame["ranks"]
        assert rank["rank"] == 0 and rank["maintenance_live"]
        assert rank["slots"] == {"free": int(SETTINGS["capture_slots"]), "capture": 0,
                                 "commit": 0}
        assert rank["pending_publications"] == 0 and rank["restores_in_flight"] == 0
        assert set(rank["rings"]) >= {"publish", "load", "filled"}
        assert rank["entries"] >= 1 and rank["used_bytes"] > 0
        assert rank["max_bytes"] == 1 << 30 and rank["low_watermark_bytes"] == 512 << 20

        # Commit SIGKILLed, its successor held STARTING: down and restarting.
        stall.touch()
        os.kill(pids["commit"], signal.SIGKILL)
        seen: dict = {}

        def restarting() -> bool:
            seen.update(_by_role(top_json(store))["commit"])
            return seen["state"] == "STARTING" and seen["pid"] not in (None, pids["commit"])

        _wait(restarting, 30, "top to show commit restarting")
        assert not seen["up"] and seen["restarts"] == 1, seen
        assert seen["last_exit"] == -signal.SIGKILL and seen["why_down"], seen
        assert seen["report_state"] in (None, "STARTING"), seen
        new_pid = seen["pid"]
        others = _by_role(top_json(store))
        assert all(others[r]["up"] and others[r]["pid"] == pids[r]
                   for r in ("capture", "maintenance", "restore")), others

        # Released: READY, so up again, with its new pid.
        stall.unlink()

        def restarted() -> bool:
            seen.update(_by_role(top_json(store))["commit"])
            return bool(seen["up"])

        _wait(restarted, 30, "top to show commit up again")
        assert seen["pid"] == new_pid == runtime(store)["workers"][1]["pid"], seen
        assert seen["state"] == "RUNNING" and seen["report_state"] == "READY"
        out = top(store, "--once", "--interval", "0.2")
        (row,) = [line.split() for line in out.stdout.splitlines()
                  if line.startswith("commit ")]
        assert row[2] == str(new_pid) and "RUNNING" in row and row[-1] == "1", row
    # pipeline() checked that the supervisor stopped cleanly and /dev/shm is empty.


def test_top_without_a_supervisor_says_so_in_one_line(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    for args in (["--once"], ["--json"], []):
        out = top(store, *args)
        assert out.returncode == 1, (args, out)
        assert out.stdout == ""
        assert out.stderr.strip().splitlines() == [
            f"sparkcache: no supervisor runs on {store} (no runtime.json); start one with "
            "`sparkcache supervise`, or name its store with --store-dir / "
            "SPARKCACHE_STORE_DIR"
        ], args


def test_top_refuses_bad_flags_naming_what_is_allowed(tmp_path: Path) -> None:
    out = top(tmp_path, "--once", "--interval", "0")
    assert out.returncode == 2 and "--interval=0.0: expected seconds above 0" in out.stderr
    out = top(tmp_path, "--once", "--sort", "size")
    assert out.returncode == 2
    assert "--sort='size': expected one of rank, role, cpu, mem, io" in out.stderr


def _row(role: str, rank: int, cpu: float | None, rss: int | None) -> WorkerRow:
    figures = ProcessFigures([0], cpu, rss, 0.0, 0.0, 0.0, 0)
    return WorkerRow(f"sparkcache::{role}[r{rank}]", role, rank, 1, "RUNNING", "READY", 0.1,
                     True, "", 0, None, figures)


def test_sorting_as_top_does() -> None:
    rows = [_row("restore", 0, 5.0, 300), _row("commit", 1, 50.0, 100),
            _row("capture", 0, None, None), _row("commit", 0, 20.0, 200)]
    names = [(r.role, r.rank) for r in sort_workers(rows, "cpu")]
    assert names == [("commit", 1), ("commit", 0), ("restore", 0), ("capture", 0)]
    names = [(r.role, r.rank) for r in sort_workers(rows, "mem")]
    assert names == [("restore", 0), ("commit", 0), ("commit", 1), ("capture", 0)]
    names = [(r.role, r.rank) for r in sort_workers(rows, "rank")]
    assert names == [("capture", 0), ("commit", 0), ("restore", 0), ("commit", 1)]
    with pytest.raises(ValueError, match="expected one of rank, role, cpu, mem, io"):
        sort_workers(rows, "size")


def test_used_bytes_bar() -> None:
    gib = 1 << 30
    assert bar(0, 40 * gib, cells=10) == "[..........] 0B/40.0G 0%"
    assert bar(10 * gib, 40 * gib, cells=10) == "[##........] 10.0G/40.0G 25%"
    assert bar(50 * gib, 40 * gib, cells=10) == "[##########] 50.0G/40.0G 125%"
    assert bar(None, 40 * gib, cells=4) == "[????] -/40.0G"


@pytest.mark.parametrize("interval", ["inf", "nan", "1e300"])
def test_top_refuses_an_interval_it_cannot_wait(tmp_path: Path, interval: str) -> None:
    """time.sleep and select cannot wait inf or 1e300 seconds: a traceback once a
    supervisor runs, unless refused first."""
    out = top(tmp_path, "--once", "--interval", interval)
    assert out.returncode == 2, out
    assert f"--interval={float(interval)}: expected seconds above 0" in out.stderr


def test_header_names_an_ipv6_endpoint_as_a_url() -> None:
    frame = Frame(at=0.0, store_dir="/s", instance="i", supervisor_pid=1,
                  metrics={"host": "::1", "port": 9464}, healthy=True, health="ok",
                  sort="rank", workers=[], ranks=[])
    assert "metrics http://[::1]:9464/metrics" in header(frame).plain
    frame = dataclasses.replace(frame, metrics={"host": "127.0.0.1", "port": 9464})
    assert "metrics http://127.0.0.1:9464/metrics" in header(frame).plain
