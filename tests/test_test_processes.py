"""The test helpers' own promise: a process a test starts ends with the test's process,
even when that process is killed from outside and no teardown runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
from pipeline_util import wait_for
from sparkcache.shm.segment import instance_entries

REPO = Path(__file__).resolve().parent.parent

# A stand-in for a pytest worker: it starts a supervisor as the tests do, prints its pid,
# and waits to be killed.
_TEST_PROCESS = """
import sys, time
from pathlib import Path
from pipeline_util import start_supervisor
proc = start_supervisor(Path(sys.argv[1]), sys.argv[2])
print(proc.pid, flush=True)
time.sleep(600)
"""


def test_a_supervisor_a_test_started_stops_when_the_test_process_is_killed(
        tmp_path: Path, instance: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    test_proc = subprocess.Popen(
        [sys.executable, "-c", _TEST_PROCESS, str(tmp_path / "store"), instance],
        stdout=subprocess.PIPE, text=True, env=env)
    started: list[psutil.Process] = []
    try:
        assert test_proc.stdout is not None
        supervisor = psutil.Process(int(test_proc.stdout.readline()))
        workers = wait_for(lambda: supervisor.children(recursive=True), 30,
                           "the supervisor's workers")
        started = [supervisor, *workers]
        test_proc.kill()  # SIGKILL: no teardown runs in it
        test_proc.wait()
        # SIGTERM from the kernel: the supervisor stops its workers and removes its
        # segments, as at any stop.
        _, alive = psutil.wait_procs(started, timeout=60)
        assert not alive, alive
        assert not instance_entries(instance)
    finally:
        if test_proc.poll() is None:
            test_proc.kill()
            test_proc.wait()
        for proc in started:
            if proc.is_running():
                proc.kill()
