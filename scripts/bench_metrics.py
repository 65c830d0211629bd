"""Benchmark of the supervisor's /metrics endpoint: what one scrape costs, and what
scraping costs an engine running beside it.

A real supervisor (``sparkcache supervise``) of ``--ranks`` ranks (4 by default, 16
workers) runs with its workers idle. Then, in one run:

* ``scrape_ms``: ``--scrapes`` back-to-back scrapes of ``/metrics`` over HTTP from this
  process (connect, request, the whole body read), median and p99 (target: median < 20 ms);
  ``collect_ms`` the same for the collector alone, read in this process from the same
  segments, and ``scrape_bytes`` the body's size;
* ``step_ratio_with_scrapes``: a fixed compute loop (a single-threaded matrix product, the
  stand-in for an engine's step) pinned to one core, its median step time without scrapes
  divided by its median step time while a separate process scrapes ``/metrics``
  ``--rate`` times a second (target >= 0.99). Windows of ``--window-s`` alternate
  (``--windows`` pairs, in ABBA order, the scraper switched on and off) so drift in a
  shared host falls on both alike; the baseline is measured in the same run.
  ``step_ratio_pair_median`` is the median of the pairs' ratios, and its 10th-90th
  percentiles show the noise. With ``--cpus`` (default: the last core) the supervisor, its
  workers and the scraper run on those cores and the loop on the first other one, as in a
  deployment that keeps SparkCache off the engine's cores; ``--same-cores`` puts
  everything on every core.

Usage: ``python scripts/bench_metrics.py [--json] [--ranks 4] [--scrapes 200] ...``
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import psutil
from sparkcache.shm import Ring
from sparkcache.workers.lifecycle import Role, title

from sparkcache import config, runtime, segments
from sparkcache.metrics.carry import Carry
from sparkcache.metrics.collector import SparkCacheCollector
from sparkcache.metrics.reading import Source, WorkerInfo

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def _scraper(url: str, rate: float, cpus: list[int] | None, active: mp.Event,
             stop: mp.Event) -> None:
    """A stand-in for Prometheus: ``rate`` scrapes a second while ``active``, until
    ``stop``."""
    if cpus:
        psutil.Process().cpu_affinity(cpus)
    period = 1.0 / rate
    while not stop.is_set():
        if not active.wait(0.05):
            continue
        due = time.monotonic()
        while active.is_set():
            _get(url)
            due += period
            time.sleep(max(0.0, due - time.monotonic()))


def _step(a: np.ndarray, b: np.ndarray, repeat: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeat):
        np.dot(a, b)
    return time.perf_counter() - t0


def _steps(seconds: float, a: np.ndarray, b: np.ndarray, repeat: int) -> list[float]:
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        out.append(_step(a, b, repeat))
    return out


def _start(store: Path, instance: str, ranks: int, port: int,
           cpus: list[int] | None) -> subprocess.Popen:
    args = [sys.executable, "-m", "sparkcache", "supervise", "--store-dir", str(store),
            "--instance", instance, "--ranks", str(ranks), "--capture-slots", "2",
            "--capture-slot-bytes", "1MiB", "--max-bytes", "1GiB",
            "--low-watermark-bytes", "512MiB", "--metrics-port", str(port)]
    if cpus:
        args += ["--cpus", ",".join(map(str, cpus))]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 120
    while runtime.read(store) is None:
        if proc.poll() is not None:
            raise SystemExit(f"supervisor exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("supervisor not ready in 120 s")
        time.sleep(0.1)
    if cpus:
        psutil.Process(proc.pid).cpu_affinity(cpus)  # the HTTP thread runs in it
    return proc


def _collect_ms(cfg: config.Config, rt: dict, n: int) -> float:
    """Median ms of the collector alone, on the running instance's segments attached here
    (rings as plain views: no end is claimed), with no HTTP."""
    segs = [
        segments.RankSegments(
            rank,
            {name: Ring.attach(segments.name(cfg.instance, rank, name), layout)
             for name, (layout, _) in segments.RINGS.items()},
            segments.attach_arena(cfg, rank), segments.attach_stats(cfg, rank),
        )
        for rank in range(cfg.ranks)
    ]
    infos = [
        WorkerInfo(w["rank"], w["role"], int(Role[w["role"].upper()]),
                   title(Role[w["role"].upper()], w["rank"]), w["state"], w["pid"],
                   w["restarts"], w["last_exit"], Carry())
        for w in rt["workers"]
    ]
    collector = SparkCacheCollector(Source(cfg, lambda: segs, lambda: infos))
    times = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            list(collector.collect())
            times.append((time.perf_counter() - t0) * 1e3)
    finally:
        for seg in segs:  # attached, not created: close() only unmaps
            seg.close()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--scrapes", type=int, default=200)
    ap.add_argument("--rate", type=float, default=10.0, help="scrapes a second")
    ap.add_argument("--windows", type=int, default=30,
                    help="pairs of windows, one without scrapes and one with")
    ap.add_argument("--window-s", type=float, default=1.0, help="seconds per window")
    ap.add_argument("--cpus", default=None,
                    help="cores of the supervisor and scraper (default: the last core)")
    ap.add_argument("--same-cores", action="store_true",
                    help="no pinning: the loop shares every core with the supervisor")
    ap.add_argument("--dir", default=None, help="store dir parent (default: a temp dir)")
    args = ap.parse_args()

    ncpu = psutil.cpu_count(logical=True) or 1
    sup_cpus: list[int] | None = None
    loop_cpus: list[int] | None = None
    if not args.same_cores and ncpu > 1:
        sup_cpus = config.parse_cpus(args.cpus) if args.cpus else [ncpu - 1]
        loop_cpus = [next(c for c in range(ncpu) if c not in sup_cpus)]
    base = Path(tempfile.mkdtemp(prefix="bench-metrics-", dir=args.dir))
    instance = "bm" + uuid.uuid4().hex[:10]
    port = _free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    sup = _start(base / "store", instance, args.ranks, port, sup_cpus)
    res: dict[str, object] = {"ranks": args.ranks, "workers": 0}
    try:
        rt = runtime.read(base / "store") or {}
        res["workers"] = len(rt.get("workers", []))
        _get(url)  # warm: imports, first connection
        times, size = [], 0
        for _ in range(args.scrapes):
            t0 = time.perf_counter()
            size = len(_get(url))
            times.append((time.perf_counter() - t0) * 1e3)
        res["scrape_ms"] = round(statistics.median(times), 3)
        res["scrape_p99_ms"] = round(_pct(times, 0.99), 3)
        res["scrape_max_ms"] = round(max(times), 3)
        res["scrape_bytes"] = size
        res["scrapes"] = args.scrapes
        cfg = config.load(env={}, overrides={
            "store_dir": str(base / "store"), "instance": instance, "ranks": str(args.ranks),
            "capture_slots": "2", "capture_slot_bytes": "1MiB", "max_bytes": "1GiB",
            "low_watermark_bytes": "512MiB"})
        res["collect_ms"] = round(_collect_ms(cfg, rt, args.scrapes), 3)

        if loop_cpus:
            psutil.Process().cpu_affinity(loop_cpus)
        rng = np.random.default_rng(0)
        a, b = rng.random((192, 192)), rng.random((192, 192))
        repeat = max(1, int(0.010 / max(1e-6, _step(a, b, 20) / 20)))  # ~10 ms a step
        _steps(1.0, a, b, repeat)  # warm
        # Short windows, alternating (ABBA), with one scraper process toggled on and off:
        # a shared host's drift, slower than a window, falls on both conditions alike.
        ctx = mp.get_context("spawn")
        active, stop = ctx.Event(), ctx.Event()
        scraper = ctx.Process(target=_scraper, args=(url, args.rate, sup_cpus, active, stop))
        scraper.start()
        steps: dict[bool, list[float]] = {False: [], True: []}
        pairs = []
        try:
            time.sleep(1.0)  # its start-up is not the scrapes' cost
            for i in range(args.windows):
                medians = {}
                for scraping in ((False, True) if i % 2 == 0 else (True, False)):
                    if scraping:
                        active.set()
                    else:
                        active.clear()
                    window = _steps(args.window_s, a, b, repeat)
                    steps[scraping] += window
                    medians[scraping] = statistics.median(window)
                pairs.append(medians[False] / medians[True])
        finally:
            active.clear()
            stop.set()
            scraper.join(10)
        base_med = statistics.median(steps[False])
        with_med = statistics.median(steps[True])
        res["step_ms_baseline"] = round(base_med * 1e3, 4)
        res["step_ms_with_scrapes"] = round(with_med * 1e3, 4)
        res["step_ratio_with_scrapes"] = round(base_med / with_med, 4)
        res["step_ratio_pair_median"] = round(statistics.median(pairs), 4)
        res["step_ratio_pair_p10_p90"] = [round(_pct(pairs, 0.1), 4), round(_pct(pairs, 0.9), 4)]
        res["steps"] = len(steps[False]) + len(steps[True])
        res["scrape_rate_per_s"] = args.rate
        res["loop_cpus"] = loop_cpus
        res["supervisor_cpus"] = sup_cpus
    finally:
        sup.send_signal(signal.SIGTERM)
        try:
            sup.wait(60)
        except subprocess.TimeoutExpired:
            sup.kill()
            sup.wait()
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps(res))
    else:
        for key, value in res.items():
            print(f"{key:28s} {value}")


if __name__ == "__main__":
    main()
