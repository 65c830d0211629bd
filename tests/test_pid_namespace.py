"""An engine in another PID namespace than its supervisor (a container without
--pid=host, a pod without shareProcessNamespace), or in a time namespace that shifts
time since boot (which start times are read in), is refused, said and counted, before
either side takes the other's live processes for dead (runtime.check_namespace)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pipeline_util import SETTINGS, start_supervisor, stop_supervisor

from sparkcache import config, runtime

REPO = Path(__file__).resolve().parent.parent
# An engine: its own PID namespace, and its own /proc as a container has (--mount-proc).
UNSHARE = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount",
           "--mount-proc"]

ENGINE = """
import json, logging, os, sys, time
logging.basicConfig(level=logging.WARNING)
from sparkcache import config
from sparkcache.prefix_lookup import PrefixLookup
from sparkcache.synthetic import SyntheticEngine, sequences

cfg = config.load()
engine = SyntheticEngine.create(cfg)
try:
    tokens = next(iter(sequences(1, cfg.page_tokens).values()))
    keys = engine.keys(tokens)
    blocks = [engine.free.pop() for _ in keys]
    took = engine.client.publish("s0", tokens, blocks)
    lookup = PrefixLookup(cfg, 1)
    hit = lookup.lookup(list(keys))
    lookup.close()
    time.sleep(3)  # capture looks for dead registrations once a second when idle
    print(json.dumps({
        "took": took, "skipped": dict(engine.client.counters.skipped), "hit": hit,
        "lookup_misses": dict(lookup.misses),
        "segment_kept": os.path.exists("/dev/shm" + engine.kv._seg.name)}))
finally:
    engine.close()
"""


# An engine in a time namespace of its own, its boot time shifted by 1000 s.
UNSHARE_TIME = ["unshare", "--user", "--map-root-user", "--time", "--boottime", "1000"]


def _unshare_works(unshare: list[str]) -> bool:
    try:
        return subprocess.run([*unshare, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _run_engine(unshare: list[str], store: Path, instance: str) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKCACHE_")}
    env |= {config.env_name(k): v for k, v in SETTINGS.items()}
    env |= {"SPARKCACHE_STORE_DIR": str(store), "SPARKCACHE_INSTANCE": instance,
            "PYTHONPATH": str(REPO)}
    out = subprocess.run([*unshare, sys.executable, "-c", ENGINE], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_the_supervisor_records_its_pid_namespace(tmp_path: Path, instance: str) -> None:
    store = tmp_path / "store"
    sup = start_supervisor(store, instance)
    try:
        rt = runtime.read(store)
        assert rt is not None and rt["pid_namespace"] == os.readlink("/proc/self/ns/pid")
        runtime.check_namespace(rt)  # the same namespace: passes
        with pytest.raises(runtime.OtherNamespace, match="--pid=host"):
            runtime.check_namespace({**rt, "pid_namespace": "pid:[1]"})
        assert rt["boottime_offset"] == runtime.boottime_offset()
        with pytest.raises(runtime.OtherNamespace, match="time since boot shifted by 5 s"):
            runtime.check_namespace({**rt, "boottime_offset": 5.0})
    finally:
        stop_supervisor(sup)


@pytest.mark.skipif(not _unshare_works(UNSHARE), reason="no unprivileged PID namespaces here")
def test_an_engine_in_another_namespace_is_refused(tmp_path: Path, instance: str) -> None:
    """Before: it connected, and capture took its registration's pid (1 in its
    namespace) for a dead process, dropped the registration and unlinked the live
    engine's KV segment; a restore worker taken for dead the same way could write into
    blocks vLLM had given to another request."""
    store = tmp_path / "store"
    sup = start_supervisor(store, instance)
    try:
        got, stderr = _run_engine(UNSHARE, store, instance)
        assert got["took"] is False
        assert got["skipped"] == {"supervisor_absent": 1}
        assert got["hit"] == 0 and got["lookup_misses"] == {"unavailable": 1}
        assert got["segment_kept"]
        assert "must share one" in stderr and "--pid=host" in stderr
    finally:
        stop_supervisor(sup)


@pytest.mark.skipif(not _unshare_works(UNSHARE_TIME),
                    reason="no unprivileged time namespaces here")
def test_an_engine_in_another_time_namespace_is_refused(tmp_path: Path, instance: str) -> None:
    """Start times are read as time since boot, which a time namespace shifts: every
    start the engine recorded read 1000 s off from the supervisor's side, its live
    registration was taken for a dead engine's and its KV segment unlinked."""
    store = tmp_path / "store"
    sup = start_supervisor(store, instance)
    try:
        got, stderr = _run_engine(UNSHARE_TIME, store, instance)
        assert got["took"] is False
        assert got["skipped"] == {"supervisor_absent": 1}
        assert got["hit"] == 0 and got["lookup_misses"] == {"unavailable": 1}
        assert got["segment_kept"]
        assert "time since boot shifted by 0 s and this process by 1000 s" in stderr
    finally:
        stop_supervisor(sup)
