#!/usr/bin/env python3
"""Capture and restore through CUDA IPC, on KV tensors in vLLM's layouts, through a real
supervisor: publish sequences, wait until each root is durable, zero the tensors, restore
every sequence and compare every page byte for byte; then zero them again, drop the store
from the page cache and load every sequence through the restore worker
(``load``/``poll_loads``), compared the same way: on a disk, the worker reads past the
page cache (``load_read_bytes``, by read path). Prints one JSON object.

    .venv/bin/python scripts/check_cuda.py [--device cuda] [--sequences 40]

Layouts, per layer tensor (fp16, 8 KV heads, head size 128, 16-token blocks):
* ``vllm-0.33``: the view vLLM 0.33 hands a connector, ``[blocks, heads, block size,
  K+V head size]`` over LBNHC memory (FLASH_ATTN on Hopper): not contiguous; each block
  is one contiguous run of physical memory.
* ``vllm-0.33-hnd``: the same view over LBHNC memory, ``[blocks, heads, block size,
  K+V head size]`` laid out as it is indexed (contiguous).
* ``kv-blocks``: ``[K/V, blocks, block size, heads, head size]``, contiguous (older vLLM,
  and the synthetic engine).
``--device cpu`` runs the same on shared-memory tensors (a dry run where no GPU is).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sparkcache.shm.layouts import READ_PATHS
from sparkcache.workers.lifecycle import Role

from sparkcache import config, segments
from sparkcache.client import SparkCacheClient
from sparkcache.filesystems import filesystem_of
from sparkcache.identity import sequence_keys
from sparkcache.kvmem import SharedKVCaches
from sparkcache.runtime import RUNTIME_FILE
from sparkcache.store.testing import evict_from_page_cache, page_bytes
from sparkcache.synthetic import sequences

LAYERS, HEADS, HEAD, TOKENS, BLOCKS = 8, 8, 128, 16, 512
GIB = 1024**3


def _tensors(layout: str, device: str, instance: str) -> tuple[list[torch.Tensor], dict, object]:
    """The layer tensors, the registration arguments, and what must be closed."""
    if layout == "vllm-0.33":
        physical = (BLOCKS, TOKENS, HEADS, 2 * HEAD)  # LBNHC: block, token, head, K+V
        order, reg = (0, 2, 1, 3), {"block_dim": 0, "block_size_dim": 2}
    elif layout == "vllm-0.33-hnd":
        physical = (BLOCKS, HEADS, TOKENS, 2 * HEAD)  # LBHNC: block, head, token, K+V
        order, reg = (0, 1, 2, 3), {"block_dim": 0, "block_size_dim": 2}
    else:
        physical = (2, BLOCKS, TOKENS, HEADS, HEAD)
        order, reg = (0, 1, 2, 3, 4), {"block_dim": 1}
    if device == "cpu":
        kv = SharedKVCaches.create(instance, 0, [physical] * LAYERS, torch.float16)
        base = kv.tensors
    else:
        kv = None
        base = [torch.zeros(physical, dtype=torch.float16, device=device) for _ in range(LAYERS)]
    return [t.permute(*order) for t in base], reg, kv


def _run(layout: str, device: str, n: int, work: Path) -> dict:
    instance = f"cuda{os.getpid()}{layout.replace('-', '').replace('.', '')}"
    store = work / layout
    settings = {
        "store_dir": str(store), "instance": instance, "capture_slots": "4",
        "capture_slot_bytes": "128MiB", "page_tokens": str(TOKENS), "max_bytes": "64GiB",
        "low_watermark_bytes": "32GiB", "metrics_port": "0", "release_timeout_seconds": "30",
        # No idle read-ahead: it may warm the pages again after the loads' pass has
        # dropped them from the page cache, and that pass is to read a cold store.
        "read_ahead_bytes": "0",
    }
    args = [sys.executable, "-m", "sparkcache", "supervise"]
    for k, v in settings.items():
        args += [config.flag_name(k), v]
    sup = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    kv = client = None
    try:
        while not (store / RUNTIME_FILE).exists():
            if sup.poll() is not None:
                raise RuntimeError(f"supervisor exited {sup.returncode}: {sup.stderr.read()}")
            time.sleep(0.05)
        cfg = config.load(env={}, overrides=settings)
        tensors, reg, kv = _tensors(layout, device, instance)
        client = SparkCacheClient(cfg, 0, model_id=f"check-cuda-{layout}")
        if not client.register_kv_caches(tensors, **reg):
            raise RuntimeError("the client refused the KV tensors (see the log)")
        views, ns = client._reg.views, client._reg.namespace
        seqs = sequences(n, TOKENS, seed=1)
        keys = {s: list(sequence_keys(ns, t).all()) for s, t in seqs.items()}
        # Each sequence in its own blocks, filled with bytes derived from its page keys.
        blocks, nxt = {}, 0
        for s, ks in keys.items():
            blocks[s] = list(range(nxt, nxt + len(ks)))
            nxt += len(ks)
            for k, b in zip(ks, blocks[s], strict=True):
                page = bytearray(page_bytes(k, views.page_bytes))  # writable: torch's view
                views.scatter(b, np.frombuffer(page, np.uint8))
        if device != "cpu":
            torch.cuda.synchronize()
        durable: set[str] = set()
        failed: dict[str, str] = {}

        def poll() -> None:
            client.poll_completions()
            for d in client.poll_durable():
                if d.durable:
                    durable.add(d.seq_id)
                else:
                    failed[d.seq_id] = d.reason

        publish_cpu = 0.0
        t0 = time.perf_counter()
        for s, t in seqs.items():
            while True:
                c0 = time.thread_time()
                ok = client.publish(s, t, blocks[s])
                if ok:  # the cost of a publication taken (a skip costs less)
                    publish_cpu += time.thread_time() - c0
                    break
                poll()
                time.sleep(0.002)
        deadline = time.monotonic() + 120
        while len(durable) + len(failed) < len(seqs) and time.monotonic() < deadline:
            poll()
            time.sleep(0.005)
        t_durable = time.perf_counter() - t0
        for t in tensors:
            t.zero_()
        pages = sum(len(k) for k in keys.values())
        restored = exact = 0
        out = np.empty(views.page_bytes, np.uint8)
        t0 = time.perf_counter()
        for s, t in seqs.items():
            while client.lookup(t) < len(t) and time.monotonic() < deadline:
                time.sleep(0.05)  # its root is durable: only the read snapshot may lag
            restored += -(-client.restore(t, blocks[s]) // TOKENS)
        if device != "cpu":
            torch.cuda.synchronize()
        t_restore = time.perf_counter() - t0
        for s, ks in keys.items():
            for k, b in zip(ks, blocks[s], strict=True):
                views.gather(b, out)
                exact += out.tobytes() == page_bytes(k, views.page_bytes)
        # The same through the restore worker: every load in flight at once, from a cold
        # store (on a disk: read past the page cache into the worker's buffers, verified
        # there, copied to staging and from staging to the blocks).
        for t in tensors:
            t.zero_()
        evict_from_page_cache(store)
        if device != "cpu":
            torch.cuda.synchronize()
        loaded: dict[str, object] = {}
        # Untimed: the worker's first load opens the registration (and may import torch).
        first = next(iter(seqs))
        if not client.load("warm-up", seqs[first][:TOKENS], blocks[first][:1]):
            raise RuntimeError(f"load refused: {client.counters.misses}")
        warm_until = time.monotonic() + 60
        while not any(r.load_id == "warm-up" for r in client.poll_loads()):
            if time.monotonic() > warm_until:
                raise RuntimeError("the restore worker never answered its first load")
            time.sleep(0.001)
        views.scatter(blocks[first][0], np.zeros(views.page_bytes, np.uint8))
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s, t in seqs.items():
            if not client.load(s, t, blocks[s]):
                raise RuntimeError(f"load refused: {client.counters.misses}")
        while len(loaded) < len(seqs) and time.monotonic() < deadline + 60:
            loaded.update((r.load_id, r) for r in client.poll_loads())
            time.sleep(0.0005)
        t_load = time.perf_counter() - t0
        loaded_exact = 0
        for s, ks in keys.items():
            for k, b in zip(ks, blocks[s], strict=True):
                views.gather(b, out)
                loaded_exact += out.tobytes() == page_bytes(k, views.page_bytes)
        with segments.attach_stats(cfg, 0) as stats:
            cap = stats.read(int(Role.CAPTURE))
            # Written at the worker's next report after the last load.
            until = time.monotonic() + 10
            while True:
                rst = stats.read(int(Role.RESTORE))
                if rst.copy_bytes >= (pages + 1) * views.page_bytes or time.monotonic() > until:
                    break
                time.sleep(0.05)
        return {
            "layout": layout, "contiguous": all(t.is_contiguous() for t in tensors),
            "page_bytes": views.page_bytes, "sequences": len(seqs), "pages": pages,
            "durable": len(durable), "not_durable": failed,
            "pages_restored": restored, "pages_byte_exact": exact,
            "publish_us_per_page_engine_cpu": round(publish_cpu / pages * 1e6, 2),
            "publish_to_durable_s": round(t_durable, 3),
            "capture_gib_s": round(cap.copy_bytes / cap.copy_seconds / GIB, 2)
            if cap.copy_seconds else None,
            "restore_gib_s": round(pages * views.page_bytes / t_restore / GIB, 3),
            "loads_ok": sum(getattr(r, "status", "") == "ok" for r in loaded.values()),
            "pages_loaded_byte_exact": loaded_exact,
            "load_gib_s": round(pages * views.page_bytes / t_load / GIB, 3),
            "load_read_bytes": {path: int(getattr(rst, f"read_bytes_{path}"))
                                for path in READ_PATHS},
            "store_filesystem": filesystem_of(store),
            "skipped": dict(client.counters.skipped), "misses": dict(client.counters.misses),
        }
    finally:
        if client is not None:
            client.close()
        if kv is not None:
            kv.close()
        sup.terminate()
        sup.wait(60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sequences", type=int, default=40)
    args = ap.parse_args()
    if args.device != "cpu" and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    out = {"device": torch.cuda.get_device_name(0) if args.device != "cpu" else "cpu",
           "torch": torch.__version__}
    with tempfile.TemporaryDirectory(prefix="sparkcache-cuda-") as work:
        out["layouts"] = [_run(layout, args.device, args.sequences, Path(work))
                          for layout in ("vllm-0.33", "vllm-0.33-hnd", "kv-blocks")]
    print(json.dumps(out, indent=1))
    ok = all(r["pages_byte_exact"] == r["pages"] == r["pages_restored"]
             == r["pages_loaded_byte_exact"] and r["durable"] == r["sequences"]
             == r["loads_ok"] for r in out["layouts"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
