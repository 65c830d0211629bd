"""A tiny ``sparkcache soak`` (seconds): the JSON's shape, every restore verified, the
read-write lanes evicting, nothing left running and nothing left in /dev/shm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from pipeline_util import ends_with_test
from sparkcache.shm.segment import instance_entries

from sparkcache.soak.params import LANES, SoakParamError, SoakParams
from sparkcache.soak.report import plot_available

REPO = Path(__file__).resolve().parent.parent
LANES_RUN = ("isolated-read-write", "inline-read-write", "restore-only")
KEYS = ("before_tok_s", "after_tok_s", "after_over_before", "first_token_before_s",
        "first_token_after_s", "step_p50_ms", "step_p99_ms", "evicted_roots",
        "reclaimed_bytes", "restores_verified", "restore_mismatches", "hit_tokens")
TINY = ["--duration", "4", "--conversations", "3", "--context-min", "256",
        "--context-max", "1024", "--tail-tokens", "128", "--decode-tokens", "8",
        "--max-bytes", "2MiB", "--low-watermark-bytes", "1536KiB", "--lease-seconds", "0.5",
        "--probes", "2", "--probe-tokens", "256", "--probe-decode-tokens", "16"]


# Put in a soak's environment, which every process it starts inherits (supervisors,
# workers, the control engine): a process left behind is found by it even once it is
# reparented, and not confused with those of soaks other tests run beside this one.
RUN_MARKER = "SOAK_TEST_RUN"


def _left_behind(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(RUN_MARKER) == marker:
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the isolated lane needs 2 cores")
def test_tiny_soak_verifies_every_restore_and_leaves_nothing(tmp_path):
    csv_dir = tmp_path / "csv"
    # The picture too, where the optional extra is installed (scripts/setup installs it).
    plotting = plot_available()
    picture = tmp_path / "soak.png"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparkcache", "soak", "--quick", "--json",
         "--lanes", ",".join(LANES_RUN), *TINY, "--csv-dir", str(csv_dir),
         "--work-dir", str(tmp_path), *(["--plot", str(picture)] if plotting else [])],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("SPARKCACHE_")},
             RUN_MARKER: str(tmp_path)},
        preexec_fn=ends_with_test(),
    )
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    lanes = json.loads(out)["lanes"]
    assert list(lanes) == list(LANES_RUN)
    # Into a pipe, progress comes as lines while it runs (a bar is drawn only at the end).
    for name in LANES_RUN:
        assert f" soak {name}: starting" in err and f" soak {name}: done" in err, err[-2000:]
    for name, fig in lanes.items():
        for key in KEYS:
            assert key in fig, (name, key)
        assert len(fig["before_tok_s"]) == len(fig["after_tok_s"]) == 2
        # The control engine ran every probe beside the engine (soak/control.py).
        assert len(fig["before_vs_control"]) == len(fig["after_vs_control"]) == 2
        assert all(x > 0 for x in fig["before_vs_control"] + fig["after_vs_control"])
        assert all(x > 0 for x in fig["before_tok_s"] + fig["after_tok_s"])
        assert fig["restore_mismatches"] == 0, name
        assert fig["restores_verified"] > 0, name
        assert fig["hit_tokens"] == fig["restores_verified"] * 16
        assert fig["lent_blocks_returned"], name
        assert (csv_dir / f"{name}.csv").stat().st_size > 0
    for name in ("isolated-read-write", "inline-read-write"):
        # Aged to the low watermark (1.5 MiB here) after the before-probes.
        assert 1_000_000 < lanes[name]["aged_bytes"] <= 1536 * 1024, name
        assert lanes[name]["evicted_roots"] > 0, (name, lanes[name])
        assert lanes[name]["reclaimed_bytes"] > 0, name
    assert lanes["isolated-read-write"]["supervisor_exit"] == 0
    if plotting:
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not _left_behind(str(tmp_path))
    prefix = f"soak{proc.pid}"
    for i in range(len(LANES)):
        assert not instance_entries(f"{prefix}{i}")
    assert not instance_entries(f"{prefix}ctl")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("sparkcache-soak-")]


def test_bad_parameters_are_refused_naming_what_is_allowed():
    with pytest.raises(SoakParamError, match="expected a comma-separated list"):
        SoakParams(lanes=("nope",)).check()
    with pytest.raises(SoakParamError, match="--low-watermark-bytes"):
        SoakParams(max_bytes=10, low_watermark_bytes=10).check()
    with pytest.raises(SoakParamError, match="--context-max"):
        SoakParams(context_min=4096, context_max=4096).check()
    result = subprocess.run(
        [sys.executable, "-m", "sparkcache", "soak", "--lanes", "isolated,off"],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "isolated-read-write" in result.stderr


def test_a_probe_is_repeated_only_where_the_host_not_sparkcache_took_the_core():
    """Other processes on the engine's core are the host's other tenants only where no
    SparkCache process may run there; in the unpinned lane they may be SparkCache's own
    workers, which that lane measures, so its probes stand."""
    from sparkcache.soak.lanes import FOREIGN_BUSY_MAX, _host_took_core
    from sparkcache.soak.workload import ProbeResult

    busy = ProbeResult("before", 0.1, 300.0, core_other_busy=FOREIGN_BUSY_MAX + 0.05)
    quiet = ProbeResult("before", 0.1, 300.0, core_other_busy=FOREIGN_BUSY_MAX / 2)
    unknown = ProbeResult("before", 0.1, 300.0, core_other_busy=None)
    repeated = {name for name, lane in LANES.items() if _host_took_core(lane, busy)}
    assert repeated == {"isolated-read-write", "restore-only", "off"}
    assert not any(_host_took_core(lane, p) for lane in LANES.values() for p in (quiet, unknown))
