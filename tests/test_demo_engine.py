"""scripts/demo_engine.py and the synthetic engine it drives, when there is nothing to
drive: a line and exit 2, no minutes of retries, no /dev/shm segment left."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pipeline_util import make_cfg

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
