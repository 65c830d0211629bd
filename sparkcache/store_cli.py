"""``sparkcache status`` and ``sparkcache fsck`` (registered in ``sparkcache.cli``).

These are the operator entry points, so (unlike the library) they print. Each returns the
process exit code: 0 healthy / consistent, 1 otherwise.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import asdict, dataclass
from pathlib import Path

from sparkcache import runtime
from sparkcache.config import GiB as GIB
from sparkcache.store import index
from sparkcache.store.fsck import DEFAULT_FSCK_GRACE_SECONDS, fsck
from sparkcache.store.layout import RankLayout, list_ranks
from sparkcache.store.records import StoreError

DEFAULT_MAX_BYTES = 40 * GIB


@dataclass(frozen=True)
class RankStatus:
    rank: int
    entries: int
    used_bytes: int
    healthy: bool
    error: str | None = None


def _rank_status(store_dir: Path, rank: int, max_bytes: int) -> RankStatus:
    layout = RankLayout(store_dir, rank)
    try:
        layout.prepare(create=False)
        conn = index.connect(layout.index_path, create=False)
    except (OSError, StoreError) as exc:
        return RankStatus(rank, 0, 0, False, str(exc))
    try:
        totals = {name: (c, b) for name, c, b in conn.execute("SELECT * FROM totals")}
    except sqlite3.DatabaseError as exc:
        return RankStatus(rank, 0, 0, False, str(exc))
    finally:
        conn.close()
    used = totals["live"][1] + totals["quarantined"][1]
    return RankStatus(rank, totals["roots"][0], used, used <= max_bytes)


def _supervisor(store_dir: Path) -> dict:
    """The supervisor as ``runtime.json`` and its pid say: running, stale or absent."""
    rt, running = runtime.read_live(store_dir)
    if rt is None:
        return {"state": "absent"}
    if not running:
        return {"state": "stale", "pid": rt.get("pid")}
    return {"state": "running", **rt}


def _supervisor_lines(sup: dict) -> list[str]:
    if sup["state"] == "absent":
        return ["sparkcache: supervisor not running"]
    if sup["state"] == "stale":
        return [f"sparkcache: supervisor not running (runtime.json of pid {sup['pid']} left "
                "by a supervisor that was killed; the next start replaces it)"]
    workers = sup["workers"]
    up = sum(w["state"] == "RUNNING" for w in workers)
    lines = [f"sparkcache: supervisor pid={sup['pid']} instance={sup['instance']} "
             f"workers={up}/{len(workers)} running cores={sup['cpus']}"]
    for w in workers:
        exit_code = "" if w["last_exit"] is None else f" last_exit={w['last_exit']}"
        lines.append(f"  {w['name']:28s} {w['state']:8s} pid={w['pid']} "
                     f"restarts={w['restarts']}{exit_code}")
    return lines


def status(store_dir: Path, json_out: bool, max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """Print the capacity line operators grep, then the supervisor and its workers (or
    JSON); 0 if every rank is within capacity and no worker of a running supervisor is
    FATAL."""
    try:
        ranks = [_rank_status(store_dir, r, max_bytes) for r in list_ranks(store_dir)]
        error = None
    except (OSError, StoreError) as exc:
        ranks, error = [], str(exc)
    sup = _supervisor(store_dir)
    fatal = [w["name"] for w in sup.get("workers", []) if w["state"] == "FATAL"]
    if fatal and error is None:
        error = f"FATAL: {', '.join(fatal)}"
    entries = sum(r.entries for r in ranks)
    used = sum(r.used_bytes for r in ranks)
    capacity = max_bytes * len(ranks)
    healthy = bool(ranks) and error is None and all(r.healthy for r in ranks)
    if json_out:
        print(
            json.dumps(
                {
                    "ranks": len(ranks),
                    "entries": entries,
                    "used_bytes": used,
                    "capacity_bytes": capacity,
                    "healthy": healthy,
                    "error": error,
                    "per_rank": [asdict(r) for r in ranks],
                    "supervisor": sup,
                }
            )
        )
    else:
        print(
            f"sparkcache: capacity ranks={len(ranks)} entries={entries} "
            f"used={used / GIB:.1f}/{capacity / GIB:.1f}GiB healthy={'yes' if healthy else 'no'}"
        )
        for line in _supervisor_lines(sup):
            print(line)
        if fatal:
            print(f"sparkcache: {error}")
    return 0 if healthy else 1


def fsck_command(
    store_dir: Path,
    json_out: bool,
    repair: bool,
    grace_seconds: float = DEFAULT_FSCK_GRACE_SECONDS,
) -> int:
    """Print every invariant violation (or JSON); 0 when the store is consistent."""
    report = fsck(store_dir, grace_seconds=grace_seconds, repair=repair)
    if json_out:
        print(json.dumps(report.as_json()))
    else:
        for problem in report.problems:
            print(problem)
        verdict = "ok" if report.ok else f"{len(report.problems)} problems"
        print(
            f"sparkcache fsck: {verdict} roots={report.roots} objects={report.objects} "
            f"quarantined={report.quarantined}"
        )
    return 0 if report.ok else 1
