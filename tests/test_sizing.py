"""``sparkcache sizing``: the arithmetic on recorded figures with known answers (keeping
pace, falling behind, a gap raised to one publication, a floor that caps the gap, a
working set that cannot fit, bytes under lease that cannot fit), bad figures refused,
planning from flags, and rates measured on a real supervisor while publications land."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from pipeline_util import make_cfg, pipeline, wait_committed
from sparkcache.shm.segment import process_start

from sparkcache import runtime
from sparkcache.cli import sizing_command
from sparkcache.cli.store_commands import _rank_status
from sparkcache.instance import Instance
from sparkcache.sizing import Figure, SizingError, SizingInputs, advise
from sparkcache.sizing_measure import Measured, RankRates, measure
from sparkcache.synthetic import sequences

MiB, GiB = 1 << 20, 1 << 30


def rec(value: float) -> Figure:
    return Figure(float(value), "recorded")


def inputs(growth: float = 10 * MiB, reclaim: float = 100 * MiB, largest: float = GiB,
           target: float = 600, lease: float = 300, **more: Figure) -> SizingInputs:
    return SizingInputs(
        net_growth_bytes_per_s=rec(growth), reclaim_bytes_per_s=rec(reclaim),
        largest_publication_bytes=rec(largest), max_bytes=rec(40 * GiB),
        low_watermark_bytes=rec(32 * GiB), target_interval_s=rec(target),
        lease_seconds=rec(lease), **more,
    )


def test_a_store_that_keeps_pace_and_fits() -> None:
    a = advise(inputs(mean_root_bytes=rec(500 * MiB)))
    assert a.keeps_pace and a.reclaim_margin_bytes_per_s == 90 * MiB
    assert a.time_to_hard_cap_s is None and a.hard_cap_bytes == 48 * GiB
    assert a.gap_now_bytes == 8 * GiB and a.interval_now_s == pytest.approx(819.2)
    assert a.gap_for_target_bytes == 6000 * MiB and not a.gap_raised_to_publication
    assert a.low_watermark_for_target_bytes == 40960 * MiB - 6000 * MiB
    assert a.removed_per_episode_bytes == 6000 * MiB
    assert a.removed_per_episode_roots == pytest.approx(12)
    assert a.episodes_per_hour == pytest.approx(6)
    assert a.mean_held_bytes == (40960 - 3000) * MiB
    assert a.context_lost_vs_smallest_gap_bytes == (6000 - 1024) // 2 * MiB
    assert a.floor_bytes == 3000 * MiB and "lease" in a.floor_source  # 10 MiB/s x 300 s
    assert a.fits and a.shortfall_bytes == 0 and a.gap_limit_bytes is None
    text = "\n".join(a.lines)
    assert "reclamation outpaces growth" in text and "[recorded]" in text
    assert "gap = net growth x target = 5.9GiB" in text


def test_reclamation_falling_behind_reaches_the_hard_cap() -> None:
    a = advise(inputs(growth=200 * MiB, reclaim=150 * MiB, lease=0))
    assert not a.keeps_pace and a.reclaim_margin_bytes_per_s == -50 * MiB
    assert a.time_to_hard_cap_s == pytest.approx(8192 / 50)  # 8 GiB gap at 50 MiB/s
    assert "FALLS BEHIND" in a.lines[0] and "2.7min" in a.lines[0]


def test_a_store_that_does_not_grow_says_no_episode_comes() -> None:
    a = advise(inputs(growth=0))
    assert a.keeps_pace and a.interval_now_s == float("inf")
    text = "\n".join(a.lines)
    assert "no episode (no net growth)" in text and "every never" not in text


def test_a_small_gap_is_raised_to_one_publication() -> None:
    a = advise(inputs(growth=MiB, target=60))
    assert a.gap_raised_to_publication and a.gap_for_target_bytes == GiB
    assert a.context_lost_vs_smallest_gap_bytes == 0


def test_a_working_set_above_the_low_watermark_caps_the_gap() -> None:
    a = advise(inputs(working_set_bytes=rec(36 * GiB)))
    assert a.fits and a.floor_bytes == 36 * GiB and "working set" in a.floor_source
    assert a.gap_limit_bytes == 4 * GiB and a.interval_limit_s == pytest.approx(409.6)
    assert "at most 4.0GiB" in a.lines[-1]


def test_a_working_set_that_cannot_fit_says_by_how_much() -> None:
    a = advise(inputs(working_set_bytes=rec(50 * GiB)))
    assert not a.fits and a.shortfall_bytes == 10 * GiB
    assert "CANNOT FIT" in a.lines[-1] and "short by 10.0GiB" in a.lines[-1]
    # At least the working set plus the gap for the target (6000 MiB).
    assert f"at least {(51200 + 6000) / 1024:.1f}GiB" in a.lines[-1]


def test_bytes_under_lease_that_cannot_fit() -> None:
    a = advise(inputs(growth=200 * MiB, reclaim=GiB, lease=300))  # 60,000 MiB leased
    assert not a.fits and a.floor_bytes == 60000 * MiB
    assert a.shortfall_bytes == (60000 - 40960) * MiB and "lease" in a.floor_source


def test_a_target_longer_than_the_store_holds() -> None:
    a = advise(inputs(growth=20 * MiB, target=3600, lease=0))
    assert a.low_watermark_for_target_bytes < 0
    assert a.removed_per_episode_bytes == 40 * GiB  # at most all of it
    assert "the longest possible is 34.1min" in a.lines[2]
    # Said so, not as a negative low watermark ("low watermark -29.3GiB").
    assert "no low watermark gives it" in a.lines[2] and "-" not in a.lines[2].split("=")[-1]


def test_bad_figures_are_refused_naming_them() -> None:
    with pytest.raises(SizingError, match=r"net_growth_bytes_per_s=-1.0 \(recorded\)"):
        advise(inputs(growth=-1))
    with pytest.raises(SizingError, match="target_interval_s: expected seconds above 0"):
        advise(inputs(target=0))
    with pytest.raises(SizingError, match="expected a finite number"):
        advise(inputs(reclaim=math.nan))


def _sizing(store: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sparkcache", "sizing", "--store-dir", str(store), *args],
        capture_output=True, text=True, timeout=120,
    )


def test_planning_from_flags_labels_every_figure(tmp_path: Path) -> None:
    out = _sizing(tmp_path, "--json", "--net-growth-bytes-per-s", "10MiB",
                  "--working-set-bytes", "50GiB", "--target-interval", "600",
                  "--max-bytes", "40GiB", "--low-watermark-bytes", "32GiB")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    src = {k: v["source"] for k, v in data["inputs"].items() if v}
    assert src["net_growth_bytes_per_s"] == "flag --net-growth-bytes-per-s"
    assert src["working_set_bytes"] == "flag --working-set-bytes"
    assert src["max_bytes"] == "config SPARKCACHE_MAX_BYTES"
    assert src["reclaim_bytes_per_s"].startswith("config: upper bound")
    assert "CAPTURE_SLOT_BYTES" in src["largest_publication_bytes"]
    assert data["advice"]["fits"] is False and data["advice"]["shortfall_bytes"] == 10 * GiB
    assert data["measured"] is None
    out = _sizing(tmp_path, "--net-growth-bytes-per-s", "10MB")
    assert out.returncode == 2
    assert "--net-growth-bytes-per-s='10MB' is invalid: expected a size" in out.stderr
    out = _sizing(tmp_path)  # nothing runs there, nothing given
    assert out.returncode == 1
    assert "no supervisor runs on" in out.stderr and "--net-growth-bytes-per-s" in out.stderr


@pytest.mark.slow
def test_rates_measured_on_a_running_instance(tmp_path: Path, instance: str) -> None:
    store = tmp_path / "store"
    with pipeline(store, instance) as engine:
        cfg = make_cfg(store, instance)
        before = _rank_status(store, 0, GiB)

        def publish_during_window(_: float) -> None:
            for sid, tokens in sequences(4, seed=3).items():
                assert engine.publish(sid, tokens), engine.client.counters
            engine.drain()
            assert wait_committed(engine, settle=2) == {}
            # Until maintenance's record shows what the index holds.
            want = _rank_status(store, 0, GiB).used_bytes
            deadline = time.monotonic() + 20
            with Instance.open(store) as inst:
                while True:
                    (m,) = [w for w in inst.read().workers if w.info.role == "maintenance"]
                    if int(m.record.used_bytes) == want:
                        break
                    assert time.monotonic() < deadline, "maintenance never caught up"
                    time.sleep(0.1)

        measured = measure(store, 0.0, cfg, sleep=publish_during_window)
        after = _rank_status(store, 0, GiB)
        (r,) = measured.ranks
        grown = after.used_bytes - before.used_bytes
        assert grown > 0
        # What commits added, less what superseding freed (not yet collected included).
        assert 0.5 * grown <= r.net_growth_bytes_per_s * r.window_s <= grown + 1
        assert r.reclaim_bytes_per_s == 0 and not r.in_episode
        assert measured.largest_root_bytes and measured.largest_root_bytes <= after.used_bytes
        assert measured.settings["max_bytes"] == GiB

        # The command on the same instance: every figure says where it came from.
        out = _sizing(store, "--json", "--window", "1")
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)
        src = {k: v["source"] for k, v in data["inputs"].items() if v}
        assert src["net_growth_bytes_per_s"].startswith("measured on rank 0 over")
        assert src["largest_publication_bytes"] == "measured: the largest root in the index"
        assert src["max_bytes"].startswith("config of supervisor pid")
        assert "no episode measured" in src["reclaim_bytes_per_s"]
        assert data["inputs"]["max_bytes"]["value"] == GiB
        assert data["measured"]["ranks"][0]["rank"] == 0


def _measured(growth: float) -> Measured:
    rank = RankRates(rank=0, window_s=10.0, net_growth_bytes_per_s=growth,
                     reclaim_bytes_per_s=0.0, in_episode=False, duty=0.0,
                     used_bytes=GiB, entries=3)
    return Measured(supervisor_pid=1, window_s=10.0, ranks=[rank], largest_root_bytes=MiB,
                    mean_root_bytes=float(MiB), settings={})


def test_a_store_that_shrank_over_the_window_is_advised_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Measured growth can be below 0 (rows collected before their files are unlinked,
    a root superseded by a smaller one): that is no growth, not a bad flag (exit 2)."""
    monkeypatch.setattr(sizing_command, "measure", lambda *_: _measured(-5 * MiB))
    cfg = make_cfg(tmp_path, "tunused")
    assert sizing_command.main(cfg, json_out=True, window_s=1.0, target_interval_s=600,
                               given={}) == 0, capsys.readouterr().err
    data = json.loads(capsys.readouterr().out)
    growth = data["inputs"]["net_growth_bytes_per_s"]
    assert growth["value"] == 0 and "measured on rank 0" in growth["source"]
    assert "shrank by 5.0MiB/s" in growth["source"]
    assert data["measured"]["ranks"][0]["net_growth_bytes_per_s"] == -5 * MiB


def test_a_supervisor_whose_segments_cannot_be_read_is_one_line(
    tmp_path: Path, instance: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    me = psutil.Process()
    runtime.write(store, {"instance": instance, "ranks": 1, "pid": me.pid,
                          "pid_start": process_start(me.pid), "cpus": [0], "workers": []})
    cfg = make_cfg(store, instance)
    assert sizing_command.main(cfg, json_out=False, window_s=0.1, target_interval_s=600,
                               given={}) == 1
    err = capsys.readouterr().err
    assert err.startswith("sparkcache: cannot read the running instance's segments: "), err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("window", [math.inf, 1e300])
def test_a_window_that_cannot_be_waited_is_refused(tmp_path: Path, window: float,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    cfg = make_cfg(tmp_path, "tunused")
    assert sizing_command.main(cfg, json_out=False, window_s=window, target_interval_s=600,
                               given={}) == 2
    assert "--window" in capsys.readouterr().err
