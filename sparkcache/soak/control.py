"""The control engine: a twin of the soak's engine with no store, in a process of its
own on the engine's core, that runs every probe at the same time as the lane's engine.

This guest's speed drifts by tens of percent within seconds (the host, its other
tenants): `off`, which runs no SparkCache, has read anywhere from 0.55 to 1.49
after/before. A probe's tok/s compares the lane with the host of that moment. Two
processes on one core at the same moment see the same host, so the engine's CPU
seconds for a probe's decode over the control's, for the same work, say what the lane
costs the engine and cancel what the host does to both (the method of
``scripts/bench_vs_lmcache.py``, docs/benchmarks.md).

What it counts: every CPU second of the engine process (its connector calls, and in the
inline lane the predecessor's threads, which are the process's own). Not its waits: a
wait spends no CPU second, so it shows in ``engine_cpu_share`` (the engine thread's CPU
time over wall time) falling below its usual half, not here. What it cancels as well:
whatever slows the core for both, which includes the store's workers' memory traffic
from the other core; step latency during the soak (``step_p99_ms`` against `off`) is
the figure for that.

The protocol is a line each way over the child's stdin and stdout: ``ready`` once it
started; then ``<phase> <index>`` in, and the probe's JSON out. End of input ends it.
This module is the parent's side; the child is ``sparkcache.soak.control_process``.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from sparkcache.soak.params import SoakParams

START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ControlProbe:
    """What the control measured over its copy of one probe."""

    decode_cpu_s: float  # the control process's CPU seconds from first token to last
    cpu_s: float  # ... over the whole probe, prefill included


class ControlEngine:
    """The parent's handle on the control process (one per soak: it has no store, so
    every lane may share it)."""

    def __init__(self, params: SoakParams, log_path: Path) -> None:
        spec = json.dumps(params.describe())
        self._log = open(log_path, "wb")  # noqa: SIM115  closed in close()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "sparkcache.soak.control_process", spec],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            bufsize=1)
        self._busy = False
        assert self._proc.stdout is not None
        # Bounded: a control that hangs as it starts must not hang the soak with it.
        try:
            started = select.select([self._proc.stdout], [], [], START_TIMEOUT_S)[0]
            line = self._proc.stdout.readline() if started else ""
        except BaseException:  # Ctrl-C, SIGTERM: the caller holds no handle to close
            self.close()
            raise
        if line.strip() != "ready":
            self.close()
            raise RuntimeError(f"the soak's control engine did not start (see {log_path}): "
                               f"{log_path.read_text()[-2000:]}")

    def start(self, phase: str, index: int) -> None:
        """Start the control's copy of probe (``phase``, ``index``); it runs while the
        caller runs its own."""
        assert self._proc.stdin is not None and not self._busy
        self._proc.stdin.write(f"{phase} {index}\n")
        self._busy = True

    def result(self) -> ControlProbe:
        """Wait for the probe started last and return what the control measured."""
        assert self._proc.stdout is not None and self._busy
        line = self._proc.stdout.readline()
        self._busy = False
        if not line:
            raise RuntimeError(f"the soak's control engine exited ({self._proc.wait()})")
        return ControlProbe(**json.loads(line))

    def close(self) -> None:
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._log.close()


def kv_blocks(params: SoakParams) -> int:
    """KV blocks of the control's engine: one probe's, and a spare."""
    return -(-(params.probe_tokens + params.probe_decode_tokens) // params.page_tokens) + 1
