"""The restore worker's loads after the store's processes and the engine restart, against
the same loads warm, measured in one run.

``scripts/bench_vs_lmcache.py`` finds turn 2 of a 16k conversation slower after vLLM and
the supervisor restart than the same turn warm. This takes vLLM out: a store is filled
with ``--prefixes`` prefixes of ``--mib`` MiB each (``bench_restore.py``'s pages), a
supervisor and an engine whose KV tensors are in shared memory start, and each prefix is
loaded twice (``warm``: the second time). Then the engine (its KV segment and client) and
the supervisor stop, both start again on the same directory, and each prefix is loaded
twice again (``restart``: the first time). Each load runs from the ``load`` call until
``poll_loads`` reports it; ``*_read_mib`` is what the restore worker read from the disk
(not the page cache) during those loads.

``restart_vs_warm`` is the median restart load over the median warm one: above 1, the
store's side pays for the restart.

``--idle S`` separates a restart from the time it takes: the prefixes then sit unread for
S seconds before the restart, and as many other prefixes, read with them, are loaded
after the same S seconds without a restart (``idle``). A host that reclaims page cache
no one has read for a while (this VM's DAMON pageout: file pages idle a minute) makes
both read from the disk; ``restart_vs_idle`` is then what the restart itself costs.

Usage: ``python scripts/bench_restart.py [--json] [--mib 256] [--prefixes 3] [--idle 0]``
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
import psutil
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

    def load(self, tag: str, tokens: list[int], blocks: list[int]) -> tuple[float, int]:
        """Seconds of one load, and the bytes the restore worker read from the disk."""
        conn = self.client._connection()
        worker = conn.restore_worker() if conn is not None else None
        if worker is None:
            raise RuntimeError("no restore worker running")
        io = psutil.Process(worker[0])
        read0 = io.io_counters().read_bytes
        t0 = time.perf_counter()
        if not self.client.load(tag, tokens, blocks):
            raise RuntimeError(f"load refused: {self.client.counters}")
        result = wait_reported(self.client, tag)
        if (result.status, result.tokens) != ("ok", len(tokens)):
            raise RuntimeError(f"load {tag}: {result}")
        return time.perf_counter() - t0, io.io_counters().read_bytes - read0

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


def bench(work: Path, mib: int, prefixes: int, idle: float) -> dict[str, object]:
    store = work / "store"
    instance = "r" + uuid.uuid4().hex[:10]
    page = LAYERS * 2 * PAGE_TOKENS * HEADS * HEAD_DIM * 2
    npages = mib * (1 << 20) // page
    shapes = [(2, npages + 8, PAGE_TOKENS, HEADS, HEAD_DIM)] * LAYERS
    blocks = list(range(npages))

    def prefix_tokens(i: int) -> list[int]:
        return (np.arange(npages * PAGE_TOKENS) + 10_000_000 * i).tolist()

    tokens = [prefix_tokens(i) for i in range(prefixes)]
    # Loaded after --idle seconds without a restart: the restart's control.
    others = [prefix_tokens(prefixes + i) for i in range(prefixes)] if idle else []
    out: dict[str, object] = {}

    def loads(rig: Rig, name: str, group: list[list[int]]) -> None:
        done = [rig.load(f"{name}-{i}", t, blocks) for i, t in enumerate(group)]
        out[name] = [round(s, 4) for s, _ in done]
        out[f"{name}_read_mib"] = round(sum(b for _, b in done) / (1 << 20), 1)

    rig = Rig(store, instance, shapes)
    try:
        ns = rig.client._reg.namespace
        for t in tokens + others:
            fill_store(store, list(sequence_keys(ns, t).all()), page)
        time.sleep(SETTLE_S)
        loads(rig, "before_first", tokens)
        loads(rig, "before_again", tokens)
        if idle:
            loads(rig, "idle_warm", others)  # read when the restart's prefixes last were
            time.sleep(idle)
            loads(rig, "idle_first", others)
    finally:
        rig.close()
    rig = Rig(store, instance, shapes)
    try:
        time.sleep(SETTLE_S)
        loads(rig, "restart_first", tokens)
        loads(rig, "restart_again", tokens)
    finally:
        rig.close()
    med = {k: statistics.median(v) for k, v in out.items() if isinstance(v, list)}
    result = {"pages": npages, "prefixes": prefixes, "idle_s": idle, **out,
              "warm_s": round(med["before_again"], 4),
              "restart_s": round(med["restart_first"], 4),
              "restart_vs_warm": round(med["restart_first"] / med["before_again"], 3)}
    if idle:
        result.update(idle_vs_warm=round(med["idle_first"] / med["before_again"], 3),
                      restart_vs_idle=round(med["restart_first"] / med["idle_first"], 3))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dir", type=Path, help="directory on the disk to measure")
    parser.add_argument("--mib", type=int, default=256, help="MiB of each prefix")
    parser.add_argument("--prefixes", type=int, default=3, help="prefixes loaded")
    parser.add_argument("--idle", type=float, default=0.0,
                        help="seconds the prefixes sit unread before the restart, with "
                             "a control loaded after as long without one (0: none)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sparkcache-bench-", dir=args.dir))
    try:
        result = bench(work, args.mib, args.prefixes, args.idle)
    finally:
        shutil.rmtree(work)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>22}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
