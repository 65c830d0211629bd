"""``sparkcache status`` and ``sparkcache fsck`` (registered in ``sparkcache.cli``).

These are the operator entry points, so (unlike the library) they print. Each returns the
process exit code: 0 healthy / consistent, 1 otherwise.
"""

from __future__ import annotations

import json
import math
import sqlite3
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from sparkcache import activity, runtime, segments
from sparkcache.config import GiB as GIB
from sparkcache.shm import SegmentError, StatsBlock, TornRead
from sparkcache.shm.layouts import WORKER_STATS
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
    healthy: bool  # within max_bytes
    error: str | None = None
    # Where entries and used come from: "live" (maintenance's current record in the
    # running instance) or "index" (read from the rank's index.sqlite).
    source: str = "index"


@dataclass(frozen=True)
class LiveView:
    """What a running instance says of itself: its reading's per-rank figures and the
    /healthz verdict."""

    ranks: list[RankStatus]
    max_bytes: int
    healthy: bool
    health: str


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


def _live(store_dir: Path, max_bytes: int) -> tuple[LiveView | None, str]:
    """The running instance's own figures, or None and why they cannot be had. Entries and
    used bytes come from each rank's maintenance record while its current process has
    reported (from the index otherwise); healthy is the verdict ``/healthz`` gives."""
    # Imported here: the reading imports the workers' lifecycle, which status without a
    # supervisor does not need.
    from sparkcache.instance import Instance, NoSupervisor
    from sparkcache.metrics import reading

    try:
        with Instance.open(store_dir) as inst:
            rt = inst.runtime
            if not rt.worker_infos():
                # A supervisor writes runtime.json only with every worker listed.
                return None, "runtime.json lists no workers"
            rd = inst.read()
    except (NoSupervisor, SegmentError, OSError) as exc:
        return None, str(exc)
    max_b = int((rt.data.get("settings") or {}).get("max_bytes", max_bytes))
    maintenance = {w.info.rank: w for w in rd.workers if w.info.role == "maintenance"}
    ranks = []
    for rank in range(rt.ranks):
        m = maintenance.get(rank)
        if m is not None and m.live and m.record is not None:
            used = int(m.record.used_bytes)
            ranks.append(RankStatus(rank, int(m.record.entries), used, used <= max_b,
                                    source="live"))
        else:
            ranks.append(_rank_status(store_dir, rank, max_b))
    healthy, why = reading.health(rd)
    return LiveView(ranks, max_b, healthy, why), ""


def _metrics_url(sup: dict) -> str | None:
    m = sup.get("metrics")
    if not m:
        return None
    host = f"[{m['host']}]" if ":" in str(m["host"]) else m["host"]
    return f"http://{host}:{m['port']}"


def _supervisor(store_dir: Path) -> dict:
    """The supervisor as ``runtime.json`` and its pid say: running, stale or absent."""
    rt, running = runtime.read_live(store_dir)
    if rt is None:
        return {"state": "absent"}
    elsewhere = runtime.other_namespace(rt)
    if elsewhere is not None:  # its pid means nothing here: neither running nor stale
        return {"state": "unknown", "pid": rt.get("pid"), "why": elsewhere}
    if not running:
        return {"state": "stale", "pid": rt.get("pid"), "settings": rt.get("settings") or {}}
    return {"state": "running", **rt}


def _supervisor_lines(sup: dict) -> list[str]:
    if sup["state"] == "absent":
        return ["sparkcache: supervisor not running"]
    if sup["state"] == "unknown":
        return [f"sparkcache: supervisor state unknown here: {sup['why']}"]
    if sup["state"] == "stale":
        return [f"sparkcache: supervisor not running (runtime.json of pid {sup['pid']} left "
                "by a supervisor that was killed; the next start replaces it)"]
    workers = sup["workers"]
    up = sum(w["state"] == "RUNNING" for w in workers)
    # One that predates this field wrote no version.
    version = f" version={sup['version']}" if "version" in sup else ""
    lines = [f"sparkcache: supervisor pid={sup['pid']}{version} instance={sup['instance']} "
             f"workers={up}/{len(workers)} running cores={sup['cpus']}"]
    for w in workers:
        exit_code = "" if w["last_exit"] is None else f" last_exit={w['last_exit']}"
        lines.append(f"  {w['name']:28s} {w['state']:8s} pid={w['pid']} "
                     f"restarts={w['restarts']}{exit_code}")
    return lines


# Slots of the rank's stats block (workers.lifecycle.Role; not imported: the CLI does not
# load the workers' modules).
_COMMIT_SLOT, _MAINTENANCE_SLOT = 1, 2


def _not_current(sup: dict, rank: int, record: tuple) -> str:
    """Why ``record`` (maintenance's slot of ``rank``) is not its current process's own
    report, or "": the slot keeps a dead process's last record, which must not read as
    the backlog now (the metrics serve no gauge from it either)."""
    for w in sup.get("workers", []):
        if w["rank"] == rank and w["role"] == "maintenance":
            if w["pid"] is not None and int(w["pid"]) == int(record.pid):
                return ""
            exit_code = "" if w["last_exit"] is None else f", last exit code {w['last_exit']}"
            return f"no report from its current process: state {w['state']}{exit_code}"
    return ""  # not listed: nothing to judge it by


def _reports(sup: dict, rank: int) -> dict:
    """Rank ``rank``'s maintenance backlog and its commits' wait for the index lock, from
    the running supervisor's stats block (docs/maintenance.md), or why there is none."""
    try:
        with StatsBlock.attach(segments.name(sup["instance"], rank, segments.STATS),
                               WORKER_STATS) as stats:
            m = stats.read(_MAINTENANCE_SLOT)
            c = stats.read(_COMMIT_SLOT)
    except (SegmentError, OSError, TornRead) as exc:
        return {"rank": rank, "error": str(exc)}
    if m is None:
        return {"rank": rank, "error": "maintenance has not reported yet"}
    if why := _not_current(sup, rank, m):
        return {"rank": rank, "error": why}
    out = {"rank": rank, "above_low_bytes": m.backlog}
    out.update({name: getattr(m, name) for name in (
        "used_bytes", "over_max_bytes", "episode_since", "selected_roots", "selected_bytes",
        "collectable_objects", "collectable_bytes", "slice_last_s", "slice_max_s",
        "evicted_roots", "cut_roots", "skipped_roots", "reclaimed_bytes",
        "collected_objects", "collected_bytes", "io_bytes", "duty", "refusing_since",
        "refused_s", "pooled_bytes", "leased_roots", "leased_bytes", "yielded_roots",
        "yielded_bytes", "read_releases", "read_yielded_roots", "free_bytes", "disk_full")})
    out["commit_lock_wait_s"] = c.lock_wait_s if c is not None else 0.0
    out["commit_lock_wait_max_s"] = c.lock_wait_max_s if c is not None else 0.0
    return out


def _size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{int(n)}B"


def _since(t: float, now: float) -> str:
    return "no" if not t else f"{now - t:.0f}s"


def _report_line(r: dict, now: float) -> str:
    name = f"maintenance[r{r['rank']}]"
    if "error" in r:
        return f"  {name:28s} no report ({r['error']})"
    return (
        f"  {name:28s} used={_size(r['used_bytes'])} above_low={_size(r['above_low_bytes'])} "
        f"above_max={_size(r['over_max_bytes'])} episode={_since(r['episode_since'], now)} "
        f"selected={r['selected_roots']}/{_size(r['selected_bytes'])} "
        f"collectable={r['collectable_objects']}/{_size(r['collectable_bytes'])} "
        f"evicted={r['evicted_roots']} reclaimed={_size(r['reclaimed_bytes'])} "
        f"collected={r['collected_objects']}/{_size(r['collected_bytes'])} "
        f"pooled={_size(r['pooled_bytes'])} "
        f"leased={r['leased_roots']}/{_size(r['leased_bytes'])} "
        f"yielded={r['yielded_roots']}/{_size(r['yielded_bytes'])} "
        f"reads_released={r['read_releases']} reads_yielded={r['read_yielded_roots']} "
        f"slice={r['slice_last_s'] * 1e3:.1f}/{r['slice_max_s'] * 1e3:.1f}ms "
        f"duty={r['duty']:.0%} commit_lock_wait_max={r['commit_lock_wait_max_s'] * 1e3:.1f}ms "
        f"refusing={_since(r['refusing_since'], now)} refused={r['refused_s']:.0f}s "
        f"disk_free={_size(r['free_bytes'])} disk_full={r['disk_full']}"
    )


def status(store_dir: Path, json_out: bool, max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """Print the capacity line operators grep, then the supervisor and its workers (or
    JSON). With a supervisor running, entries and used bytes are its maintenance
    workers' live figures and healthy is the /healthz verdict (every worker READY with a
    fresh heartbeat), followed by its restores and hit rate (``activity.json``); without
    one, they come from the index and healthy means every rank is within the
    ``max_bytes`` the last supervisor ran with (``settings.json``; ``max_bytes`` for a
    store none ran on), and the stores this user's supervisors do serve are named.
    Returns 0 when healthy."""
    sup = _supervisor(store_dir)
    live, why_not_live = _live(store_dir, max_bytes) if sup["state"] == "running" else (None, "")
    error = None
    if live is not None:
        ranks, capacity_each = live.ranks, live.max_bytes
    else:
        # What the store was run with: a killed supervisor's runtime file says it, and
        # every supervisor keeps its settings in the store, read once it has stopped.
        settings = sup.get("settings") or runtime.last_settings(store_dir) or {}
        capacity_each = int(settings.get("max_bytes", max_bytes))
        try:
            ranks = [_rank_status(store_dir, r, capacity_each) for r in list_ranks(store_dir)]
        except (OSError, StoreError) as exc:
            ranks, error = [], str(exc)
        if not ranks and error is None:
            error = f"no ranks in {store_dir}: nothing was ever stored there"
    fatal = [w["name"] for w in sup.get("workers", []) if w["state"] == "FATAL"]
    if fatal and error is None:
        error = f"FATAL: {', '.join(fatal)}"
    if sup["state"] == "stale" and error is None:
        # Killed, not stopped: the engines it served get misses and refusals until a
        # supervisor starts again. A probe built on status must see that.
        error = (f"the supervisor (pid {sup['pid']}) was killed: nothing is served from "
                 "this store until one starts again")
    reports = ([_reports(sup, r) for r in range(int(sup["ranks"]))]
               if sup["state"] == "running" else [])
    entries = sum(r.entries for r in ranks)
    used = sum(r.used_bytes for r in ranks)
    capacity = capacity_each * len(ranks)
    if live is not None:
        healthy = live.healthy  # the verdict /healthz gives, word for word
    else:
        healthy = bool(ranks) and error is None and all(r.healthy for r in ranks)
    metrics = _metrics_url(sup)
    done = activity.read(store_dir) if sup["state"] == "running" else None
    # No supervisor on this store: say where this user's run, if anywhere (a status run
    # without --store-dir looks at the default one).
    elsewhere = ([n for n in segments.running_stores()
                  if n["store_dir"] != str(Path(store_dir).resolve())]
                 if sup["state"] != "running" else [])
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
                    "live": live is not None,
                    "live_error": why_not_live or None,
                    "health": live.health if live is not None else None,
                    "metrics_url": metrics,
                    "supervisor": sup,
                    "maintenance": reports,
                    "activity": done,
                    "elsewhere": [{"instance": n.get("instance"), "store_dir": n["store_dir"],
                                   "supervisor_pid": n.get("supervisor_pid")}
                                  for n in elsewhere],
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
        for n in elsewhere:
            print(f"sparkcache: a supervisor (pid {n.get('supervisor_pid')}) runs instance "
                  f"{n.get('instance')!r} on store {n['store_dir']}: sparkcache status "
                  f"--store-dir {n['store_dir']}")
        if done is not None:
            for line in activity.lines(done):
                print(f"sparkcache: {line}")
        if metrics is not None:
            print(f"sparkcache: metrics {metrics}/metrics and {metrics}/healthz")
        if live is not None and live.healthy:
            print(f"sparkcache: health {live.health}")
        elif live is not None:
            print("sparkcache: health not ok (/healthz would answer 503):")
            for line in live.health.splitlines():
                print(f"  {line}")
        elif why_not_live:
            print(f"sparkcache: no live figures ({why_not_live}); entries and used from "
                  "the index")
        now = time.time()
        for report in reports:
            print(_report_line(report, now))
        # healthy=no always says why: a rank that cannot be read, the store dir, FATAL.
        for r in ranks:
            if r.error is not None:
                print(f"sparkcache: rank {r.rank}: {r.error}")
        if error is not None:
            print(f"sparkcache: {error}")
    return 0 if healthy else 1


def fsck_command(
    store_dir: Path,
    json_out: bool,
    repair: bool,
    grace_seconds: float = DEFAULT_FSCK_GRACE_SECONDS,
) -> int:
    """Print every invariant violation (or JSON); 0 when the store is consistent, 2 for
    a grace that is no age."""
    # Below 0, --repair would sweep what a running commit is writing; nan and inf would
    # never find an orphan or temp file old enough to report.
    if not 0 <= grace_seconds < math.inf:
        print(f"sparkcache: --grace-seconds={grace_seconds}: expected seconds of at least 0 "
              f"(default {DEFAULT_FSCK_GRACE_SECONDS:g}; a commit may be writing younger "
              "files)", file=sys.stderr)
        return 2
    # A running commit renames a file into place before its index transaction names it:
    # the grace is all that keeps a repair from removing it, so a live supervisor keeps
    # the default one (a check alone removes nothing).
    rt, running = runtime.read_live(store_dir)
    # One in another PID or time namespace cannot be judged from here: it may be running.
    unseen = runtime.other_namespace(rt) is not None
    if repair and (running or unseen) and grace_seconds < DEFAULT_FSCK_GRACE_SECONDS:
        state = "may be running (in another namespace)" if unseen else "is running"
        print(f"sparkcache: a supervisor (pid {rt['pid']}) {state} on {store_dir}: "
              f"--repair with --grace-seconds={grace_seconds:g} could remove files its "
              f"commit is writing; keep the default ({DEFAULT_FSCK_GRACE_SECONDS:g}) or "
              "stop the supervisor first", file=sys.stderr)
        return 2
    report = fsck(store_dir, grace_seconds=grace_seconds, repair=repair)
    if json_out:
        print(json.dumps(report.as_json()))
    else:
        for problem in report.problems:
            print(problem)
        n = len(report.problems)
        verdict = "ok" if report.ok else f"{n} problem{'' if n == 1 else 's'}"
        print(
            f"sparkcache fsck: {verdict} roots={report.roots} objects={report.objects} "
            f"quarantined={report.quarantined} pooled={report.pooled_files} "
            f"({report.pooled_bytes / 2**20:.1f} MiB) "
            f"unpunched={report.unpunched_bytes / 2**20:.1f} MiB"
        )
    return 0 if report.ok else 1
