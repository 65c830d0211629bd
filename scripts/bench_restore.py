"""The restore worker's load throughput against a sequential read of the same object files,
both from a cold page cache, measured in one run.

A store is filled with ``--mib`` of pages of an 8-layer model (8 KV heads, head size 128,
fp16, 16-token pages: 512 KiB a page), committed straight through ``PageStore``. A real
supervisor then runs its workers beside an engine whose KV tensors are in shared memory.
Each round, the three in turn (each goes first as often: the first reader after an
eviction takes other free memory than the next, and on a guest whose host takes free
memory back that decides who meets the slow pages), every file evicted before each:

* sequential: every file of the prefix (a pack per 64 pages), in page order, evicted from
  the page cache (``posix_fadvise(DONTNEED)``), opened and read whole into one reused
  buffer: the disk's and the kernel's share of a restore, with no checksum and no
  copy into blocks;
* restore worker: one ``load`` of the whole prefix into fresh blocks, timed from the
  call until ``poll_loads`` reports it (the engine thread spends only the ``load`` call
  on it: ``load_call_ms``); afterwards every block is checked byte for byte;
* synchronous ``restore``, the engine-thread path, for reference.

With the restore worker's load, a one-page load is asked for just after it, into a spare
block: ``one_page_behind_ms`` is the time until it is reported, ``one_page_vs_load`` that
time over the large load's (about 1 where the worker serves loads one at a time; far
below where it serves them in turn).

The worker's first load (one page, untimed) comes first: it imports torch and opens the
registration then. ``--warm`` leaves the files in the page cache: what the CPU allows.
``guest_reports_free_memory``: whether this machine is a VM that hands its free memory
back to its host (``scripts/guest_memory.py``): memory the host took back is slow at its
next use, which is what made this bench's slow rounds on such a guest.

Usage: ``python scripts/bench_restore.py [--json] [--dir D] [--mib 256] [--rounds 6]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import guest_memory  # scripts/, beside this file
import numpy as np
import torch
from sparkcache.workers.lifecycle import Role, State

from sparkcache import config, segments
from sparkcache.client import LoadResult, SparkCacheClient
from sparkcache.identity import sequence_keys
from sparkcache.kvmem import SharedKVCaches
from sparkcache.runtime import RUNTIME_FILE
from sparkcache.store import PageData, PageStore, Root
from sparkcache.store.testing import drop_from_page_cache, object_file, page_bytes

GIB = 1 << 30
LAYERS, HEADS, HEAD_DIM, PAGE_TOKENS = 8, 8, 128, 16
SETTINGS = {"ranks": "1", "capture_slots": "1", "capture_slot_bytes": "16MiB",
            "page_tokens": str(PAGE_TOKENS), "max_bytes": "64GiB",
            "low_watermark_bytes": "32GiB"}


def sequential_read(paths: list[Path], buf: bytearray) -> float:
    """Read every file whole, in order, ``buf`` at a time."""
    view = memoryview(buf)
    start = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while os.readv(fd, [view]):
                pass
        finally:
            os.close(fd)
    return time.perf_counter() - start


def fill_store(store_dir: Path, keys: list[str], page: int) -> list[Path]:
    """Commit ``keys`` as roots of 64 pages (a pack each); the files in page order."""
    with PageStore(store_dir, 0) as store:
        for i in range(0, len(keys), 64):
            part = keys[i : i + 64]
            root = os.urandom(16).hex()
            store.commit(Root(root, [PageData(k, page_bytes(k, page)) for k in part]))
        files = [object_file(store.layout.objects_dir, store._rconn, k)[0] for k in keys]
    return list(dict.fromkeys(files))


def start_supervisor(store: Path, instance: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "sparkcache", "supervise", "--store-dir", str(store),
            "--instance", instance]
    for k, v in SETTINGS.items():
        args += [config.flag_name(k), v]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    while not (store / RUNTIME_FILE).exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"supervisor did not start: {proc.communicate()[1][-2000:]}")
        time.sleep(0.05)
    return proc


def wait_reported(client: SparkCacheClient, load_ids: list[str],
                  timeout: float = 300) -> dict[str, tuple[LoadResult, float]]:
    """Each load's report and when it came (``time.perf_counter``)."""
    deadline = time.monotonic() + timeout
    got: dict[str, tuple[LoadResult, float]] = {}
    while time.monotonic() < deadline:
        for result in client.poll_loads():
            got[result.load_id] = (result, time.perf_counter())
        if set(load_ids) <= set(got):
            return got
        time.sleep(0.0005)
    raise RuntimeError(f"loads {load_ids} not reported: {client.counters}")


def bench(work: Path, mib: int, rounds: int, cold: bool = True) -> dict[str, float]:
    store_dir = work / "store"
    instance = "b" + uuid.uuid4().hex[:10]
    cfg = config.load(env={}, overrides={"store_dir": str(store_dir), "instance": instance,
                                         **SETTINGS})
    page = LAYERS * 2 * PAGE_TOKENS * HEADS * HEAD_DIM * 2
    npages = mib * (1 << 20) // page
    shapes = [(2, npages + 8, PAGE_TOKENS, HEADS, HEAD_DIM)] * LAYERS
    # The supervisor first: it refuses to start beside segments of its instance.
    sup = start_supervisor(store_dir, instance)
    kv = SharedKVCaches.create(instance, 0, shapes, torch.float16)
    client = SparkCacheClient(cfg, 0, model_id="bench-8l")
    try:
        if not client.register_kv_caches(kv.tensors):
            raise RuntimeError("registration refused")
        views = client._reg.views
        assert views.page_bytes == page
        tokens = np.arange(npages * PAGE_TOKENS).tolist()
        keys = list(sequence_keys(client._reg.namespace, tokens).all())
        paths = fill_store(store_dir, keys, page)
        with segments.attach_stats(cfg, 0) as stats:
            deadline = time.monotonic() + 60
            while True:
                rec = stats.read(int(Role.RESTORE))
                if rec is not None and rec.state == State.READY:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("restore worker not READY")
                time.sleep(0.05)
        blocks = list(range(npages))
        # Not timed: the worker imports torch and opens the registration at its first load.
        if not client.load("warm-up", tokens[:PAGE_TOKENS], blocks[:1]):
            raise RuntimeError(f"load refused: {client.counters}")
        wait_reported(client, ["warm-up"])
        buf = bytearray(page + 64)
        seq_s, load_s, sync_s, call_s, one_s = [], [], [], [], []
        out = np.empty(page, np.uint8)

        def sequential() -> None:
            seq_s.append(sequential_read(paths, buf))

        def worker_load(r: int) -> None:
            for t in kv.tensors:
                t.zero_()
            t0 = time.perf_counter()
            if not client.load(f"r{r}", tokens, blocks):
                raise RuntimeError(f"load refused: {client.counters}")
            call_s.append(time.perf_counter() - t0)
            # A one-page load asked just after it, into a spare block: how long it waits.
            if not client.load(f"one{r}", tokens[:PAGE_TOKENS], [npages]):
                raise RuntimeError(f"load refused: {client.counters}")
            ends = wait_reported(client, [f"r{r}", f"one{r}"])
            (result, end), (one, one_end) = ends[f"r{r}"], ends[f"one{r}"]
            load_s.append(end - t0)
            one_s.append(one_end - t0)
            if (result.status, result.tokens) != ("ok", len(tokens)) or one.status != "ok":
                raise RuntimeError(f"load: {result}, {one}")
            for k, b in zip(keys, blocks, strict=True):
                views.gather(b, out)
                if out.tobytes() != page_bytes(k, page):
                    raise RuntimeError(f"block {b} does not hold page {k}")

        def sync_restore() -> None:
            t0 = time.perf_counter()
            restored = client.restore(tokens, blocks)
            sync_s.append(time.perf_counter() - t0)
            if restored != len(tokens):
                raise RuntimeError(f"restore: {restored} of {len(tokens)} tokens")

        for r in range(rounds):
            steps = [sequential, partial(worker_load, r), sync_restore]
            for step in steps[r % 3:] + steps[: r % 3]:
                if cold:
                    drop_from_page_cache(paths)
                step()
        total = npages * page
        seq, load, sync = (statistics.median(x) for x in (seq_s, load_s, sync_s))
        return {
            "page_cache": "cold" if cold else "warm",
            "pages": npages,
            "page_bytes": page,
            "gib": total / GIB,
            "rounds": rounds,
            "sequential_gib_s": total / GIB / seq,
            "restore_gib_s": total / GIB / load,
            "restore_vs_sequential": seq / load,
            "restore_gib_s_each": [round(total / GIB / s, 3) for s in load_s],
            "sequential_gib_s_each": [round(total / GIB / s, 3) for s in seq_s],
            "sync_restore_gib_s": total / GIB / sync,
            "load_call_ms": statistics.median(call_s) * 1000,
            "one_page_behind_ms": statistics.median(one_s) * 1000,
            "one_page_vs_load": statistics.median(one_s) / load,
        }
    finally:
        client.close()
        kv.close()
        if sup is not None:
            sup.send_signal(signal.SIGTERM)
            try:
                sup.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                sup.kill()
                sup.communicate()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dir", type=Path, help="directory on the disk to measure")
    parser.add_argument("--mib", type=int, default=256, help="MiB of stored pages loaded")
    parser.add_argument("--rounds", type=int, default=6,
                        help="rounds, the sides in turn first; medians reported")
    parser.add_argument("--warm", action="store_true",
                        help="leave the files in the page cache (what the CPU allows)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sparkcache-bench-", dir=args.dir))
    try:
        result = bench(work, args.mib, args.rounds, cold=not args.warm)
    finally:
        shutil.rmtree(work)
    result["guest_reports_free_memory"] = guest_memory.reports_free_memory()
    result = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>24}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
