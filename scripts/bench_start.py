"""How long a supervisor takes to start on a store of millions of page rows: after the
store was made, after a clean stop, and after the supervisor and its workers were
SIGKILLed, each against the READY limit (60 s), and against the whole repair a start
used to run (``PageStore.reconcile``: every row read, every file listed), timed in the
same run.

The store is made in SQL and sparse files (``sparkcache.store.testing.populate_packs``):
``--rows`` pages of 4 KiB (so that the default 40 GiB cap holds them and nothing is
evicted while the starts are timed) in packs of 256 records, roots of 20,000 pages (a
320k-token conversation at 16 tokens a page). ``ready_s`` is from the supervisor's spawn
until runtime.json lists every worker RUNNING; ``maintenance_ready_s`` is what the
supervisor logged for maintenance (its index check). ``sweep_unit_ms`` is one unit of the
sweep maintenance runs after a start (``recovery.sweep_units(3)``), for 32 units.

Usage: ``python scripts/bench_start.py [--json] [--rows 10000000] [--dir D]``
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil

from sparkcache.runtime import RUNTIME_FILE
from sparkcache.store import PageStore
from sparkcache.store.recovery import sweep_units
from sparkcache.store.testing import populate_packs

PAGE_BYTES = 4096
PACK_RECORDS = 256
ROOT_PAGES = 20_000
READY_LIMIT_S = 60.0


def start(store: Path, instance: str) -> tuple[subprocess.Popen, float]:
    """A supervisor on ``store``, and the seconds until every worker was RUNNING."""
    t0 = time.monotonic()
    sup = subprocess.Popen(
        [sys.executable, "-m", "sparkcache", "supervise", "--store-dir", str(store),
         "--instance", instance], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    deadline = t0 + 10 * READY_LIMIT_S
    while time.monotonic() < deadline:
        if sup.poll() is not None:
            raise RuntimeError(f"supervisor exited {sup.returncode}: "
                               f"{sup.stderr.read()[-2000:]}")
        try:
            rt = json.loads((store / RUNTIME_FILE).read_text())
        except (OSError, ValueError):
            rt = {}
        # A killed supervisor's runtime.json names it, its workers RUNNING, until this
        # one writes its own.
        workers = rt.get("workers") if rt.get("pid") == sup.pid else None
        if workers and all(w["state"] == "RUNNING" for w in workers):
            return sup, time.monotonic() - t0
        time.sleep(0.05)
    kill(sup)
    raise RuntimeError("workers not RUNNING in 600 s")


def stop(sup: subprocess.Popen) -> float:
    """A clean stop; maintenance's READY time from the supervisor's log."""
    sup.send_signal(signal.SIGTERM)
    _, err = sup.communicate(timeout=120)
    if sup.returncode != 0:
        raise RuntimeError(f"supervisor exited {sup.returncode}: {err[-2000:]}")
    return maintenance_ready(err)


def kill(sup: subprocess.Popen) -> float:
    """SIGKILL the supervisor and every worker (its session), as a power cut would."""
    procs = [psutil.Process(sup.pid), *psutil.Process(sup.pid).children(recursive=True)]
    os.killpg(sup.pid, signal.SIGKILL)
    psutil.wait_procs(procs, timeout=30)
    _, err = sup.communicate(timeout=30)
    return maintenance_ready(err)


def maintenance_ready(log: str) -> float:
    found = re.findall(r"maintenance\[r0\] READY after ([0-9.]+)s", log)
    return float(found[-1]) if found else float("nan")


def bench(work: Path, rows: int) -> dict[str, object]:
    store = work / "store"
    instance = f"bst{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    with PageStore(store, 0) as ps:
        populate_packs(ps, rows, PAGE_BYTES, PACK_RECORDS, ROOT_PAGES, time.time())
    built = time.monotonic() - t0
    ready, maintenance = {}, {}
    sup, ready["first"] = start(store, instance)
    maintenance["first"] = stop(sup)
    sup, ready["after_clean_stop"] = start(store, instance)
    maintenance["after_clean_stop"] = kill(sup)
    sup, ready["after_sigkill"] = start(store, instance)
    maintenance["after_sigkill"] = stop(sup)
    with PageStore(store, 0, create=False) as ps:
        t0 = time.perf_counter()
        ps.check_index()
        check = time.perf_counter() - t0
        units = []
        for unit in sweep_units(3)[::128]:
            t0 = time.perf_counter()
            ps.sweep([unit])
            units.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        ps.reconcile()
        whole = time.perf_counter() - t0
    slowest = max(ready.values())
    return {
        "rows": rows,
        "build_s": round(built, 1),
        "index_mib": round((store / "rank-0" / "index.sqlite").stat().st_size / 2**20),
        "ready_s": {k: round(v, 2) for k, v in ready.items()},
        "maintenance_ready_s": maintenance,
        "ready_limit_s": READY_LIMIT_S,
        "slowest_ready_over_limit": round(slowest / READY_LIMIT_S, 3),
        "check_index_s": round(check, 2),
        "whole_repair_s": round(whole, 1),
        "slowest_ready_over_whole_repair": round(slowest / whole, 3),
        "sweep_unit_ms": {"p50": round(statistics.median(units), 1),
                          "max": round(max(units), 1), "units": len(units)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000,
                        help=f"page rows (a multiple of {ROOT_PAGES})")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to make the store (a temporary directory otherwise)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-start-", dir=args.dir))
    try:
        out = bench(work, args.rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
