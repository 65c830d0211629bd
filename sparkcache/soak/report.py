"""What a soak prints, writes and draws: the before/after table, one CSV per lane, the
JSON object and the picture."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from sparkcache.config import MiB
from sparkcache.soak.lanes import LaneResult

PLOT_EXTRA_HINT = ("--plot needs matplotlib, an optional extra: pip install "
                   "'sparkcache[plot]' (or pip install matplotlib) into this environment")


def as_json(results: dict[str, LaneResult]) -> dict[str, object]:
    return {"lanes": {name: r.figures for name, r in results.items()}}


def _tok(xs: object) -> str:
    return " / ".join(f"{x:.1f}" for x in xs)  # type: ignore[attr-defined]


def _busy(xs: object) -> str:
    """The mean of per-probe shares, as a percentage."""
    known = [x for x in xs if x is not None]  # type: ignore[attr-defined]
    return f"{100 * sum(known) / len(known):.0f}%" if known else "?"


def _secs(xs: object) -> str:
    return " / ".join(f"{x:.3f}" for x in xs)  # type: ignore[attr-defined]


def table(results: dict[str, LaneResult]) -> str:
    """The before/after table (markdown), then the soak's own figures."""
    lines = [
        "| lane | decode tok/s before | after | after/before, tok/s "
        "| speed over the control, before | after | after/before "
        "| first token before (s) "
        "| after (s) | engine core taken by others, before / after "
        "| engine thread's CPU share, before / after |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        f = r.figures
        lines.append(
            f"| {name} | {_tok(f['before_tok_s'])} | {_tok(f['after_tok_s'])} "
            f"| {f['after_over_before_wall']:.3f} "
            f"| {_secs(f['before_vs_control'])} | {_secs(f['after_vs_control'])} "
            f"| {f['after_over_before']:.3f} "
            f"| {_secs(f['first_token_before_s'])} | {_secs(f['first_token_after_s'])} "
            f"| {_busy(f['core_other_busy_before'])} / {_busy(f['core_other_busy_after'])} "
            f"| {_busy(f['engine_cpu_share_before'])} / {_busy(f['engine_cpu_share_after'])} |")
    lines += [
        "",
        "| lane | step p50 / p99 ms (soak) | turns | commit mean s | evicted roots "
        "| reclaimed MiB | used max MiB | restores verified / mismatched | hit tokens | skips |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        f = r.figures
        skips = ", ".join(f"{k} {v}" for k, v in f["skips"].items()) or "-"  # type: ignore[attr-defined]
        lines.append(
            f"| {name} | {f['step_p50_ms']:.2f} / {f['step_p99_ms']:.2f} | {f['turns']} "
            f"| {f.get('commit_mean_s', 0):.3f} | {f['evicted_roots']} "
            f"| {f['reclaimed_bytes'] / MiB:.1f} | {f['used_bytes_max'] / MiB:.1f} "
            f"| {f['restores_verified']} / {f['restore_mismatches']} | {f['hit_tokens']} "
            f"| {skips} |")
    return "\n".join(lines)


def write_csvs(results: dict[str, LaneResult], csv_dir: Path) -> list[Path]:
    """``<csv_dir>/<lane>.csv``: the lane's timeline, a row a quarter second; and
    ``soak.json``, what ``--json`` prints, so one run gives both the table and the JSON."""
    csv_dir.mkdir(parents=True, exist_ok=True)
    (csv_dir / "soak.json").write_text(json.dumps(as_json(results), indent=1) + "\n")
    out = []
    for name, r in results.items():
        fields: list[str] = []
        for row in r.timeline:
            fields += [k for k in row if k not in fields]
        path = csv_dir / f"{name}.csv"
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(r.timeline)
        out.append(path)
    return out


def plot_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(results: dict[str, LaneResult], path: Path) -> None:
    """Step latency, used bytes against both watermarks and commit durations over time,
    one column per lane. ImportError without matplotlib (``PLOT_EXTRA_HINT``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = list(results)
    fig, axes = plt.subplots(3, len(lanes), figsize=(4 * len(lanes), 8), squeeze=False,
                             sharex="col")
    for col, name in enumerate(lanes):
        r = results[name]
        t0 = r.steps[0].at if r.steps else 0.0
        ax = axes[0][col]
        ax.plot([s.at - t0 for s in r.steps], [s.ms for s in r.steps], ",", alpha=0.5)
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("step ms" if col == 0 else "")
        ax.set_yscale("log")
        rows = [row for row in r.timeline if "used_bytes" in row]
        ax = axes[1][col]
        ax.plot([row["t_s"] for row in rows], [row["used_bytes"] / MiB for row in rows])
        ax.axhline(r.figures["max_bytes"] / MiB, color="red", linestyle="--", lw=0.8)
        ax.axhline(r.figures["low_watermark_bytes"] / MiB, color="green", linestyle="--",
                   lw=0.8)
        ax.set_ylabel("used MiB" if col == 0 else "")
        ax = axes[2][col]
        rows = [row for row in r.timeline if row.get("commits")]
        ax.plot([row["t_s"] for row in rows], [row["commit_mean_s"] for row in rows], ".")
        ax.set_ylabel("commit s (mean per ¼ s)" if col == 0 else "")
        ax.set_xlabel("s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
