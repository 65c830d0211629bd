"""scripts/demo_engine.py and the synthetic engine it drives, when there is nothing to
drive: a line and exit 2, no minutes of retries, no /dev/shm segment left; and when it
is stopped with SIGTERM mid-run: its KV cache's segment goes with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pipeline_util import ends_with_test, make_cfg, start_supervisor, stop_supervisor
from sparkcache.shm.segment import instance_entries, segment_name

from sparkcache.segments import engine_segment_role
from sparkcache.synthetic import SyntheticEngine

REPO = Path(__file__).resolve().parent.parent


def test_no_supervisor_is_said_at_once(tmp_path, instance):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKCACHE_")}
    env |= {"SPARKCACHE_STORE_DIR": str(tmp_path / "store"), "SPARKCACHE_INSTANCE": instance}
    t0 = time.monotonic()
    result = subprocess.run([sys.executable, "scripts/demo_engine.py", "--sequences", "3"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "no supervisor runs on" in result.stderr
    assert "Traceback" not in result.stderr
    # Before: every publication skipped ("supervisor_absent") and retried for 4 s.
    assert time.monotonic() - t0 < 10


def test_a_refused_client_leaves_no_kv_segment(tmp_path, instance):
    """The ``instance`` fixture fails the test if the KV cache's segment is left."""
    cfg = make_cfg(tmp_path / "store", instance)
    with pytest.raises(ValueError, match="model_id"):
        SyntheticEngine.create(cfg, model_id=" ")


def test_sigterm_mid_run_leaves_no_kv_segment(tmp_path, instance):
    store = tmp_path / "store"
    sup = start_supervisor(store, instance)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKCACHE_")}
        env |= {"SPARKCACHE_STORE_DIR": str(store), "SPARKCACHE_INSTANCE": instance}
        demo = subprocess.Popen([sys.executable, "scripts/demo_engine.py", "--sequences",
                                 "100000"], cwd=REPO, env=env, stderr=subprocess.PIPE,
                                text=True, preexec_fn=ends_with_test())
        try:
            mine = segment_name(instance, 0, engine_segment_role(demo.pid))[1:]
            deadline = time.monotonic() + 60
            while mine not in instance_entries(instance):
                assert demo.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            demo.send_signal(signal.SIGTERM)
            _, err = demo.communicate(timeout=60)
        finally:
            if demo.poll() is None:
                demo.kill()
                demo.communicate()
        assert demo.returncode == 128 + signal.SIGTERM, err[-3000:]
        assert "Traceback" not in err
        # Checked while the supervisor runs: stopping it unlinks the rank's segments.
        assert mine not in instance_entries(instance)
    finally:
        stop_supervisor(sup)
