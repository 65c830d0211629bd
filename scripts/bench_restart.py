"""The restore worker's loads after the store's processes and the engine restart, against
the same loads warm, measured in one run, the page cache warm throughout.

``scripts/bench_vs_lmcache.py`` finds turn 2 of a 16k conversation slower after vLLM and
the supervisor restart than the same turn warm. This takes vLLM out: a store is filled
with ``--prefixes`` prefixes of ``--mib`` MiB each (``bench_restore.py``'s pages), a
supervisor and an engine whose KV tensors are in shared memory start, and each prefix is
loaded twice (``warm``: the second time). Then the engine (its KV segment and client) and
the supervisor stop, both start again on the same directory, and each prefix is loaded
twice again (``restart``: the first time). Each load runs from the ``load`` call until
``poll_loads`` reports it.

``restart_vs_warm`` is the median restart load over the median warm one: above 1, the
store's side pays for the restart.

Usage: ``python scripts/bench_restart.py [--json] [--mib 256] [--prefixes 3]``
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
from bench_restore import (
    HEAD_DIM,
    HEADS,
    LAYERS,
    PAGE_TOKENS,
    SETTINGS,
    fill_store,
    start_supervisor,
    wait_reported,
)

from sparkcache import config
from sparkcache.client import SparkCacheClient
from sparkcache.identity import sequence_keys
from sparkcache.kvmem import SharedKVCaches

SETTLE_S = 3.0  # idle time before the first load: the restore worker opens the KV then


class Rig:
    """A supervisor and an engine's KV and client on one store."""

    def __init__(self, store: Path, instance: str, shapes: list[tuple[int, ...]]) -> None:
        self.cfg = config.load(env={}, overrides={"store_dir": str(store),
                                                  "instance": instance, **SETTINGS})
        self.sup: subprocess.Popen | None = start_supervisor(store, instance)
        self.kv = SharedKVCaches.create(instance, 0, shapes, torch.float16)
        for t in self.kv.tensors:
            t.zero_()
        self.client = SparkCacheClient(self.cfg, 0, model_id="bench-8l")
        if not self.client.register_kv_caches(self.kv.tensors):
            self.close()
            raise RuntimeError("registration refused")

    def load(self, tag: str, tokens: list[int], blocks: list[int]) -> float:
        t0 = time.perf_counter()
        if not self.client.load(tag, tokens, blocks):
            raise RuntimeError(f"load refused: {self.client.counters}")
        result = wait_reported(self.client, tag)
        if (result.status, result.tokens) != ("ok", len(tokens)):
            raise RuntimeError(f"load {tag}: {result}")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.client.close()
        self.kv.close()
        if self.sup is not None:
            self.sup.send_signal(signal.SIGTERM)
            try:
                self.sup.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                self.sup.kill()
                self.sup.communicate()
            self.sup = None


def bench(work: Path, mib: int, prefixes: int) -> dict[str, object]:
    store = work / "store"
    instance = "r" + uuid.uuid4().hex[:10]
    page = LAYERS * 2 * PAGE_TOKENS * HEADS * HEAD_DIM * 2
    npages = mib * (1 << 20) // page
    shapes = [(2, npages + 8, PAGE_TOKENS, HEADS, HEAD_DIM)] * LAYERS
    blocks = list(range(npages))
    tokens = [(np.arange(npages * PAGE_TOKENS) + 10_000_000 * i).tolist()
              for i in range(prefixes)]
    out: dict[str, list[float]] = {}

    def both_passes(rig: Rig, phase: str) -> None:
        time.sleep(SETTLE_S)
        for n, name in enumerate((f"{phase}_first", f"{phase}_again")):
            out[name] = [round(rig.load(f"{phase}{n}-{i}", t, blocks), 4)
                         for i, t in enumerate(tokens)]

    rig = Rig(store, instance, shapes)
    try:
        ns = rig.client._reg.namespace
        for t in tokens:
            fill_store(store, list(sequence_keys(ns, t).all()), page)
        both_passes(rig, "before")
    finally:
        rig.close()
    rig = Rig(store, instance, shapes)
    try:
        both_passes(rig, "restart")
    finally:
        rig.close()
    warm = statistics.median(out["before_again"])
    return {"pages": npages, "prefixes": prefixes, **out,
            "warm_s": round(warm, 4),
            "restart_s": round(statistics.median(out["restart_first"]), 4),
            "restart_vs_warm": round(statistics.median(out["restart_first"]) / warm, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dir", type=Path, help="directory on the disk to measure")
    parser.add_argument("--mib", type=int, default=256, help="MiB of each prefix")
    parser.add_argument("--prefixes", type=int, default=3, help="prefixes loaded")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sparkcache-bench-", dir=args.dir))
    try:
        result = bench(work, args.mib, args.prefixes)
    finally:
        shutil.rmtree(work)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>16}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
