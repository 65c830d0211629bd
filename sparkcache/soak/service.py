"""A lane's SparkCache: a fresh supervisor (``python -m sparkcache supervise``) on a
fresh store, its settings, what its workers report, and its stop."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sparkcache import config, segments
from sparkcache.config import Config
from sparkcache.runtime import RUNTIME_FILE
from sparkcache.shm import TornRead
from sparkcache.shm.layouts import DURATION_BUCKETS_S
from sparkcache.soak.params import SoakParams
from sparkcache.workers.lifecycle import Role

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0


def settings(params: SoakParams, store_dir: Path, instance: str, access_mode: str,
             cpus: list[int] | None, slot_bytes: int) -> dict[str, str]:
    """``SPARKCACHE_*`` variables of a lane's supervisor (and of its engine's client)."""
    env = {
        "store_dir": str(store_dir), "instance": instance, "ranks": "1",
        "max_bytes": str(params.max_bytes),
        "low_watermark_bytes": str(params.low_watermark_bytes),
        "access_mode": access_mode, "capture_slots": "2",
        "capture_slot_bytes": str(slot_bytes), "page_tokens": str(params.page_tokens),
        "lease_seconds": str(params.lease_seconds),
        "lookup_lease_seconds": str(params.lookup_lease_seconds), "metrics_port": "0",
    }
    if cpus:
        env["cpus"] = ",".join(map(str, cpus))
    return {config.env_name(k): v for k, v in env.items()}


@dataclass
class StatsSample:
    """One reading of the workers' stats slots (docs/pipeline.md, ``worker_stats``)."""

    at: float  # perf_counter
    used_bytes: int
    evicted_roots: int
    cut_roots: int
    reclaimed_bytes: int
    collected_bytes: int
    commits: int  # roots committed
    commit_sum_s: float
    commit_buckets: list[int]  # cumulative counts per DURATION_BUCKETS_S bound
    slice_max_s: float
    refused_s: float
    captured: int


class Service:
    def __init__(self, cfg: Config, proc: subprocess.Popen, log_file: Path) -> None:
        self.cfg = cfg
        self.proc = proc
        self.log_file = log_file
        self._stats = segments.attach_stats(cfg, 0)

    @classmethod
    def start(cls, env: dict[str, str], log_file: Path) -> Service:
        """Start the supervisor (it pins itself and its workers to ``env``'s cores) and
        wait until every worker is READY (it writes runtime.json then)."""
        cfg = config.load(env=env)
        full_env = {k: v for k, v in os.environ.items()
                    if not k.startswith(config.ENV_PREFIX)} | env
        with open(log_file, "ab") as out:
            proc = subprocess.Popen(  # our own interpreter and module
                [sys.executable, "-m", "sparkcache", "supervise"], env=full_env,
                stdout=out, stderr=subprocess.STDOUT,
                cwd=os.getcwd(),
            )
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            runtime = cfg.store_dir / RUNTIME_FILE
            while not runtime.exists():
                if proc.poll() is not None:
                    raise RuntimeError(f"the supervisor exited with code {proc.returncode} "
                                       f"at start-up; its log: {log_file}")
                if time.monotonic() > deadline:
                    proc.kill()
                    proc.wait()
                    raise RuntimeError(f"the supervisor was not ready in "
                                       f"{START_TIMEOUT_S:g}s; its log: {log_file}")
                time.sleep(0.05)
            return cls(cfg, proc, log_file)
        except BaseException:
            # Interrupted (Ctrl-C, SIGTERM) or failed before the caller holds a Service
            # to stop: stop the supervisor here, or it outlives the soak with its workers
            # and segments.
            _stop(proc)
            raise

    def sample(self) -> StatsSample | None:
        try:
            maint = self._stats.read(int(Role.MAINTENANCE), retries=64)
            commit = self._stats.read(int(Role.COMMIT), retries=64)
            capture = self._stats.read(int(Role.CAPTURE), retries=64)
        except TornRead:
            return None
        if maint is None or commit is None:
            return None  # not reported yet; capture runs in read-write mode only
        return StatsSample(
            time.perf_counter(), int(maint.used_bytes), int(maint.evicted_roots),
            int(maint.cut_roots), int(maint.reclaimed_bytes), int(maint.collected_bytes),
            int(commit.dur_count), float(commit.dur_sum_s),
            [int(getattr(commit, f"dur_le_{i}")) for i in range(len(DURATION_BUCKETS_S))],
            float(maint.slice_max_s), float(maint.refused_s),
            int(capture.processed) if capture is not None else 0,
        )

    def stop(self) -> int:
        """SIGTERM (drain, stop the workers, unlink every segment); its exit code."""
        self._stats.close()
        return _stop(self.proc)


def _stop(proc: subprocess.Popen) -> int:
    """SIGTERM ``proc`` (a supervisor) unless it ended; its exit code, killed past
    STOP_TIMEOUT_S."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.warning("the supervisor did not stop in %gs; killing it", STOP_TIMEOUT_S)
        proc.kill()
        return proc.wait()
