"""Benchmark of the pipeline through a real supervisor, measured in one run.

* publish_us_per_page: CPU time of the calling thread in ``SparkCacheClient.publish()``
  in this (the engine) process, per page of the publications it took; the wall time too
  (``publish_wall_us_per_page``), which on a machine without spare cores includes being
  descheduled for the workers.
* capture_gib_s vs memcpy_gib_s: bytes the capture worker copied into slots over the CPU
  time it spent copying (its stats block), against a plain single-thread copy of the same
  number of bytes in this process (CPU time too), same run; and against the same bytes
  copied in capture's run size (memcpy_runs_gib_s, one layer's K or V of one block).
* pipeline_mib_s: page bytes published over the time from the first publish to the last
  root committed (capture, commit with fsync, index transaction).
* cuda: not implemented yet; reported as skipped, with the reason.

Usage: ``python scripts/bench_pipeline.py [--json] [--pubs N] [--pages N]``
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from shm import StatsBlock
from shm.layouts import WORKER_STATS
from sparkcache import config, segments
from sparkcache.client import SparkCacheClient
from sparkcache.kvmem import SharedKVCaches
from sparkcache.supervisor import RUNTIME_FILE
from workers.lifecycle import Role

GIB = 1 << 30
MIB = 1 << 20
PAGE_TOKENS = 16
# 8 layers of [K/V, blocks, 16 tokens, 8 KV heads, 128] fp16: 512 KiB pages.
LAYERS, HEADS, HEAD_DIM = 8, 8, 128


def memcpy_gib_s(nbytes: int, chunk: int | None = None, rounds: int = 5) -> float:
    """A plain single-thread copy of ``nbytes`` (CPU time, best of ``rounds``): in one
    call, or in ``chunk``-byte memmoves, the size of the runs capture copies."""
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time()
        if chunk is None:
            np.copyto(dst, src)
        else:
            s, d = src.ctypes.data, dst.ctypes.data
            for off in range(0, nbytes - chunk + 1, chunk):
                ctypes.memmove(d + off, s + off, chunk)
        best = min(best, time.thread_time() - t0)
    return nbytes / best / GIB


def run(pubs: int, pages: int, work: Path) -> dict:
    instance = f"bench{os.getpid()}"
    store = work / "store"
    settings = {
        "store_dir": str(store), "instance": instance, "capture_slots": "4",
        "capture_slot_bytes": f"{pages + 1}MiB", "page_tokens": str(PAGE_TOKENS),
        "max_bytes": "64GiB", "low_watermark_bytes": "32GiB", "metrics_port": "0",
    }
    args = [sys.executable, "-m", "sparkcache", "supervise"]
    for k, v in settings.items():
        args += [config.flag_name(k), v]
    sup = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kv = None
    client = None
    try:
        while not (store / RUNTIME_FILE).exists():
            if sup.poll() is not None:
                raise RuntimeError(f"supervisor exited {sup.returncode}")
            time.sleep(0.05)
        cfg = config.load(env={}, overrides=settings)
        blocks = pubs * pages
        shape = (2, blocks, PAGE_TOKENS, HEADS, HEAD_DIM)
        kv = SharedKVCaches.create(instance, 0, [shape] * LAYERS, torch.float16)
        for t in kv.tensors:
            t.normal_()
        client = SparkCacheClient(cfg, 0, release_timeout_s=30.0)
        assert client.register_kv_caches(kv.tensors)
        page_bytes = client._reg.page_bytes
        rng = np.random.default_rng(1)
        seqs = [rng.integers(0, 50000, pages * PAGE_TOKENS).tolist() for _ in range(pubs)]
        stats = StatsBlock.attach(segments.name(instance, 0, segments.STATS), WORKER_STATS)
        publish_s, publish_wall_s, taken = 0.0, 0.0, 0
        t_start = time.perf_counter()
        for i, tokens in enumerate(seqs):
            ids = list(range(i * pages, (i + 1) * pages))
            while True:
                t0, w0 = time.thread_time(), time.perf_counter()
                ok = client.publish(f"s{i}", tokens, ids)
                dt, dw = time.thread_time() - t0, time.perf_counter() - w0
                if ok:
                    publish_s += dt
                    publish_wall_s += dw
                    taken += 1
                    break
                client.poll_completions()
                time.sleep(0.002)
        while True:
            rec = stats.read(int(Role.COMMIT))
            if rec[4] >= taken:
                break
            client.poll_completions()
            time.sleep(0.002)
        t_end = time.perf_counter()
        cap = stats.read(int(Role.CAPTURE))
        stats.close()
        copy_bytes, copy_s = cap[8], cap[9]
        capture = copy_bytes / copy_s / GIB
        memcpy = memcpy_gib_s(copy_bytes)
        run_bytes = PAGE_TOKENS * HEADS * HEAD_DIM * 2  # one layer's K or V of one block
        memcpy_runs = memcpy_gib_s(copy_bytes // run_bytes * run_bytes, chunk=run_bytes)
        return {
            "page_bytes": page_bytes,
            "publications": taken,
            "pages": taken * pages,
            "skipped": dict(client.counters.skipped),
            "publish_us_per_page": round(publish_s / (taken * pages) * 1e6, 2),
            "publish_wall_us_per_page": round(publish_wall_s / (taken * pages) * 1e6, 2),
            "capture_gib_s": round(capture, 2),
            "memcpy_gib_s": round(memcpy, 2),
            "capture_vs_memcpy": round(capture / memcpy, 3),
            # The same bytes copied in capture's run size: large copies get non-temporal
            # stores from glibc, 32 KiB runs do not.
            "memcpy_runs_gib_s": round(memcpy_runs, 2),
            "capture_vs_memcpy_runs": round(capture / memcpy_runs, 3),
            "pipeline_mib_s": round(taken * pages * page_bytes / (t_end - t_start) / MIB, 1),
        }
    finally:
        if client is not None:
            client.close()
        if kv is not None:
            kv.close()
        sup.send_signal(signal.SIGTERM)
        try:
            sup.wait(60)
        except subprocess.TimeoutExpired:
            sup.kill()
            sup.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--pubs", type=int, default=16)
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--dir", type=Path, default=None)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sparkcache-bench-", dir=a.dir))
    try:
        result = run(a.pubs, a.pages, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["cuda"] = (
        "skipped: the capture CUDA path is untested here" if torch.cuda.is_available()
        else "skipped: no CUDA device"
    )
    if a.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:22s} {v}")


if __name__ == "__main__":
    main()
