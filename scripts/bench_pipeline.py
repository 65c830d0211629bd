"""Benchmark of the pipeline through a real supervisor, measured in one run.

* publish_us_per_page: CPU time of the calling thread in ``SparkCacheClient.publish()``
  in this (the engine) process, per page of the publications it took; the wall time too
  (``publish_wall_us_per_page``), which on a machine without spare cores includes being
  descheduled for the workers.
* capture_gib_s vs memcpy_gib_s: bytes the capture worker copied into slots over the CPU
  time it spent copying (its stats block), against a plain single-thread memcpy of the
  same bytes in this process, same run: each publication's bytes, read from the same KV
  tensors in the longest contiguous runs their layout has (one per layer and K/V), into
  one of ``capture_slots`` slot-sized buffers in turn, as capture fills slots. A slot
  bounds every copy capture can make, so the baseline copies slot by slot too.
  ``memcpy_one_call_gib_s`` is the same byte count in one call, for reference: past
  glibc's non-temporal threshold (3/4 of the shared cache the CPU reports; 192 MiB on
  the CI-sized guest) memcpy switches to streaming stores and runs about twice as fast,
  which no copy of one slot reaches.
* pipeline_mib_s: page bytes published over the time from the first publish to the last
  root committed (capture, commit with fsync, index transaction).
* cuda: the same run with the KV tensors on a CUDA device (capture opens them through
  CUDA IPC handles), its baseline a plain device-to-host copy of the same bytes in the
  same runs; ``skipped`` with the reason where there is no device.

Usage: ``python scripts/bench_pipeline.py [--json] [--pubs N] [--pages N]``
"""

from __future__ import annotations

import argparse
import json
import mmap
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
from sparkcache.shm import StatsBlock
from sparkcache.shm.layouts import WORKER_STATS
from sparkcache.workers.lifecycle import Role

from sparkcache import config, segments
from sparkcache.client import SparkCacheClient
from sparkcache.kvmem import SharedKVCaches
from sparkcache.runtime import RUNTIME_FILE

GIB = 1 << 30
MIB = 1 << 20
PAGE_TOKENS = 16
SLOTS = 4
# 8 layers of [K/V, blocks, 16 tokens, 8 KV heads, 128] fp16: 512 KiB pages.
LAYERS, HEADS, HEAD_DIM = 8, 8, 128


def _runs(tensors: list[torch.Tensor], first: int, count: int) -> list[torch.Tensor]:
    """The bytes of blocks ``first .. first+count-1``: one contiguous run per layer and
    K/V, the longest runs a [K/V, blocks, ...] layout has."""
    return [t[kv, first : first + count] for t in tensors for kv in range(t.shape[0])]


def baseline_gib_s(tensors: list[torch.Tensor], pubs: int, pages: int, rounds: int = 5
                   ) -> float:
    """Plain single-thread copies of every publication's bytes into slot-sized buffers
    taken in turn (CPU time, best of ``rounds``); a device-to-host copy for CUDA tensors.
    The buffers are anonymous memory that numpy does not ask huge pages for, like slots."""
    nbytes = sum(r.numel() * r.element_size() for r in _runs(tensors, 0, pages))
    bufs = [np.frombuffer(mmap.mmap(-1, nbytes), np.uint8) for _ in range(SLOTS)]
    for b in bufs:
        b[::4096] = 0  # faulted in, as capture's slots are
    hosts = [torch.from_numpy(b) for b in bufs]
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time()
        for i in range(pubs):
            host, off = hosts[i % SLOTS], 0
            for run in _runs(tensors, i * pages, pages):
                n = run.numel() * run.element_size()
                if run.is_cuda:
                    host[off : off + n].copy_(run.view(-1).view(torch.uint8))
                else:
                    np.copyto(bufs[i % SLOTS][off : off + n],
                              run.view(-1).view(torch.uint8).numpy())
                off += n
        best = min(best, time.thread_time() - t0)
    return pubs * nbytes / best / GIB


def one_call_gib_s(nbytes: int, rounds: int = 5) -> float:
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time()
        np.copyto(dst, src)
        best = min(best, time.thread_time() - t0)
    return nbytes / best / GIB


def run(pubs: int, pages: int, work: Path, device: str) -> dict:
    instance = f"bench{os.getpid()}{device[:4]}"
    store = work / device / "store"
    settings = {
        "store_dir": str(store), "instance": instance, "capture_slots": str(SLOTS),
        "capture_slot_bytes": f"{pages + 1}MiB", "page_tokens": str(PAGE_TOKENS),
        "max_bytes": "64GiB", "low_watermark_bytes": "32GiB", "metrics_port": "0",
        "release_timeout_seconds": "30",
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
        shape = (2, pubs * pages, PAGE_TOKENS, HEADS, HEAD_DIM)
        if device == "cpu":
            kv = SharedKVCaches.create(instance, 0, [shape] * LAYERS, torch.float16)
            tensors = kv.tensors
        else:
            tensors = [torch.empty(shape, dtype=torch.float16, device=device)
                       for _ in range(LAYERS)]
        for t in tensors:
            t.normal_()
        client = SparkCacheClient(cfg, 0, model_id="bench-pipeline-8l")
        assert client.register_kv_caches(tensors)
        page_bytes = client._reg.views.page_bytes
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
            if rec.processed >= taken:
                break
            client.poll_completions()
            time.sleep(0.002)
        t_end = time.perf_counter()
        cap = stats.read(int(Role.CAPTURE))
        stats.close()
        copy_bytes, copy_s = cap.copy_bytes, cap.copy_seconds
        capture = copy_bytes / copy_s / GIB
        memcpy = baseline_gib_s(tensors, pubs, pages)
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
            "memcpy_one_call_gib_s": round(one_call_gib_s(copy_bytes), 2),
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
        result = run(a.pubs, a.pages, work, "cpu")
        if torch.cuda.is_available():
            cuda = run(a.pubs, a.pages, work, "cuda")
            result["cuda"] = {k: v for k, v in cuda.items() if k != "memcpy_one_call_gib_s"}
        else:
            result["cuda"] = "skipped: no CUDA device"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:22s} {v}")


if __name__ == "__main__":
    main()
