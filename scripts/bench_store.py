"""Micro-benchmark of the page store against the raw disk, measured in one run.

* commit vs raw: committing roots of 1 MiB pages (checksum, write, rename, one syncfs,
  index transaction) against writing and fsyncing plain 1 MiB files one by one on the same
  disk; rounds alternate so drift in the disk affects both alike.
* restore vs raw read: both read files evicted from the page cache (posix_fadvise DONTNEED).
* commit and restore vs the disk's limit: publications of 64 and of 4,096 pages of
  ``--page-kib`` (512 KiB: 16 tokens of an 8-layer, 8-head, 128-dim fp16 model, the page
  ``bench_restore.py`` uses; 0.5-2 MiB is typical of 7-8B models at 16 tokens a page, or
  of larger ones split over tensor-parallel ranks) are committed (checksums, files, one
  syncfs, index transaction), next to the same bytes written as one file with one
  fsync; then restored and, next to it, that file read sequentially, all from a cold page
  cache (every file durable, then evicted with posix_fadvise DONTNEED: writing
  /proc/sys/vm/drop_caches needs privileges). ``restore``: the restore worker's read path
  (its reader pool, chunks and read-ahead: ``WorkerReads``), all but the copy into KV
  blocks; ``restore_sync``: ``PageStore.restore`` on the calling thread (the engine-thread
  path of tests and the GPU check). The filesystem is synced before each timed step so
  none pays for another's writeback, and the sides take turns going first; 64-page
  publications run 16 rounds per 4,096-page round. ``*_vs_sequential_<P>`` is
  SparkCache's throughput over the baseline's (higher is better), from the medians of
  the rounds' times; ``*_all_rounds_<P>``, from their sums, is what this bench reported
  before 2026-12-05, and ``*_slow_rounds_<P>`` counts the rounds that took over twice
  their side's median. ``commit_vs_sequential`` and ``restore_vs_sequential`` are the
  lower of the two sizes.
* victim selection: 1,000 LRU victims among 1,000,000 roots through the index, next to a
  full scan-and-sort of the same table (the old maintenance pass). The unary ``+`` keeps
  SQLite from using the index for the scan (``NOT INDEXED`` does not stop it from using a
  covering secondary index of a WITHOUT ROWID table).
* sweep: a fan-out directory of ``--sweep-files`` objects swept (the start-up reconcile's
  work per directory, and the maintenance worker's re-sweep of one directory a slice),
  the directory's inodes dropped from the cache first where this process may
  (``sweep_cold``: writing /proc/sys/vm/drop_caches needs root). ``sweep_lock_ms`` is
  how long its write transaction held the index's write lock, which every commit of the
  rank waits for; ``sweep_ms`` the whole sweep. Medians of 5.
* supersession: the commit of a ``--long-pages`` root extended by one page (it supersedes
  the root before it), and the search for the roots a commit supersedes next to a join
  probing every position of the new root, once for that long root and once for a new
  conversation where ``--sharing`` roots share a ``--shared-pages`` system prompt. Pages
  are 64 bytes and the WAL is not fsynced, so the index's work is what is measured.
* ``guest_reports_free_memory``: whether this machine is a VM that hands its free memory
  back to its host (``scripts/guest_memory.py``). Memory the host took back is slow at
  its next use: restores met it as slow rounds on such a guest.

Usage: ``python scripts/bench_store.py [--json] [--dir D] [--pages N] [--roots N]
[--page-kib K] [--seq-rounds R] [--sweep-files N]``
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import guest_memory  # scripts/, beside this file
import numpy as np
from sparkcache.workers.restore import CHUNK_BYTES, READERS, STAGED_CHUNKS, _ReaderPool

from sparkcache.store import PageStore, index, recovery
from sparkcache.store.reader import StoreReader
from sparkcache.store.testing import drop_from_page_cache, make_root

MIB = 1 << 20
PAGES_PER_ROOT = 16


def raw_write(directory: Path, payloads: list[bytes]) -> tuple[float, list[Path]]:
    paths = []
    start = time.perf_counter()
    for i, data in enumerate(payloads):
        path = directory / f"raw-{i}-{time.monotonic_ns()}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        paths.append(path)
    return time.perf_counter() - start, paths


def raw_read(paths: list[Path], buf: bytearray) -> float:
    view = memoryview(buf)
    start = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.readv(fd, [view])
        finally:
            os.close(fd)
    return time.perf_counter() - start


def bench_io(work: Path, pages: int, rounds: int) -> dict[str, float]:
    raw_dir = work / "raw"
    raw_dir.mkdir(mode=0o700)
    store = PageStore(work / "store", 0)
    per_round = pages // rounds
    raw_s = commit_s = raw_read_s = restore_s = 0.0
    raw_rounds: list[list[Path]] = []
    root_rounds: list[list[list[str]]] = []
    for _ in range(rounds):
        keys = [os.urandom(16).hex() for _ in range(per_round)]
        batch = [keys[i : i + PAGES_PER_ROOT] for i in range(0, per_round, PAGES_PER_ROOT)]
        built = [make_root(os.urandom(16).hex(), b, MIB) for b in batch]
        payloads = [bytes(p.data) for root in built for p in root.pages]
        seconds, paths = raw_write(raw_dir, payloads)
        raw_s += seconds
        raw_rounds.append(paths)
        start = time.perf_counter()
        for root in built:
            store.commit(root)
        commit_s += time.perf_counter() - start
        root_rounds.append(batch)
    written = per_round * rounds
    object_paths = [p for p in store.layout.objects_dir.rglob("*.*") if p.is_file()]
    buf = bytearray(MIB)
    buffers = [bytearray(MIB) for _ in range(PAGES_PER_ROOT)]
    restored = 0
    for paths, batch in zip(raw_rounds, root_rounds, strict=True):
        drop_from_page_cache([p for r in raw_rounds for p in r] + object_paths)
        raw_read_s += raw_read(paths, buf)
        start = time.perf_counter()
        for keys in batch:
            restored += store.restore(keys, buffers)
        restore_s += time.perf_counter() - start
    store.close()
    if restored != written:
        raise RuntimeError(f"restored {restored} of {written} pages")
    return {
        "pages": written,
        "page_bytes": MIB,
        "commit_mib_s": written / commit_s,
        "raw_write_mib_s": written / raw_s,
        "commit_vs_raw": raw_s / commit_s,
        "restore_mib_s": written / restore_s,
        "raw_read_mib_s": written / raw_read_s,
        "restore_vs_raw": raw_read_s / restore_s,
    }


def sequential_write(path: Path, payloads: list[bytes]) -> float:
    """The disk's write limit: ``payloads`` appended to one new file, fsynced once."""
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for data in payloads:
            os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def sequential_read(path: Path, chunk: bytearray) -> float:
    """The disk's read limit: ``path`` read front to back into a reused buffer."""
    view = memoryview(chunk)
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.readv(fd, [view]):
            pass
    finally:
        os.close(fd)
    return time.perf_counter() - start


def timed_in_turn(
    fns: list[Callable[[], object]], turn: int, before: Callable[[], None]
) -> list[tuple[float, object]]:
    """``(seconds, result)`` of each of ``fns``, run in an order rotated by ``turn`` (so
    over rounds each goes first as often), each after ``before()``."""
    done = {}
    shift = turn % len(fns)
    for fn in fns[shift:] + fns[:shift]:
        before()
        start = time.perf_counter()
        result = fn()
        done[fn] = (time.perf_counter() - start, result)
    return [done[fn] for fn in fns]


class WorkerReads:
    """The restore worker's read path as ``Restore._read_and_write`` drives it: the plan
    read in ``CHUNK_BYTES`` chunks by its reader pool (``READERS`` threads, each with its
    own ``StoreReader``), ``STAGED_CHUNKS`` of them ahead; all but the copy into KV
    blocks."""

    def __init__(self, store: PageStore, page_bytes: int) -> None:
        self._plan = store._reader.plan
        layout = store.layout
        self._pool = _ReaderPool(
            lambda direct: StoreReader(layout.store_dir, layout.rank, direct=direct), READERS)
        self._chunk = max(1, CHUNK_BYTES // page_bytes)
        self._staging = [np.empty((self._chunk, page_bytes), np.uint8)
                         for _ in range(STAGED_CHUNKS)]

    def close(self) -> None:
        self._pool.close()

    def restore(self, keys: list[str]) -> int:
        """Pages of ``keys`` read and verified, in order, up to the first missing or bad."""
        plan = self._plan(keys)
        starts = iter(range(0, len(plan), self._chunk))
        free = list(range(len(self._staging)))
        inflight: deque[tuple[int, int, Future]] = deque()

        def submit(start: int) -> None:
            buf = free.pop()
            chunk = plan[start : start + self._chunk]
            inflight.append((len(chunk), buf, self._pool.submit(chunk, self._staging[buf])))

        for start in itertools.islice(starts, len(free)):
            submit(start)
        restored = 0
        while inflight:
            want, buf, fut = inflight.popleft()
            got = fut.result().pages
            restored += got
            free.append(buf)
            if got < want:
                for _, _, rest in inflight:
                    rest.result()
                break
            nxt = next(starts, None)
            if nxt is not None:
                submit(nxt)
        return restored


def bench_vs_sequential(
    work: Path, page_bytes: int, pages: int, rounds: int
) -> dict[str, float]:
    """Commit and restore of ``pages``-page publications against one file of the same bytes
    written with one fsync and read sequentially, ``rounds`` times, in turn."""
    seq_dir = work / f"seq-{pages}"
    seq_dir.mkdir(mode=0o700)
    each: dict[str, list[float]] = {
        side: [] for side in ("commit", "write", "restore", "restore_sync", "read")}
    # PageStore.restore's buffers are reused every 16 pages: pages are read in order, so a
    # long prefix needs no memory of its own size.
    bufs = [bytearray(page_bytes) for _ in range(16)]
    into = [bufs[i % len(bufs)] for i in range(pages)]
    with PageStore(work / f"store-{pages}", 0, lease_seconds=0) as store:
        reads = WorkerReads(store, page_bytes)
        try:
            for r in range(rounds):
                keys = [os.urandom(16).hex() for _ in range(pages)]
                root = make_root(os.urandom(16).hex(), keys, page_bytes)
                path = seq_dir / f"round-{r}"
                write = partial(sequential_write, path, [bytes(p.data) for p in root.pages])
                (commit_s, _), (write_s, _) = timed_in_turn(
                    [partial(store.commit, root), write], r, before=os.sync
                )
                if r == 0:
                    reads.restore(keys)  # untimed: each reader thread opens its index
                objects = [p for p in store.layout.objects_dir.rglob("*.*") if p.is_file()]
                (restore_s, n), (sync_s, n_sync), (read_s, _) = timed_in_turn(
                    [partial(reads.restore, keys), partial(store.restore, keys, into),
                     partial(sequential_read, path, bufs[0])],
                    r, before=partial(drop_from_page_cache, [path, *objects]),
                )
                if (n, n_sync) != (pages, pages):
                    raise RuntimeError(f"restored {n} and {n_sync} of {pages} pages")
                seconds = (commit_s, write_s, restore_s, sync_s, read_s)
                for side, s in zip(each, seconds, strict=True):
                    each[side].append(s)
                # Untimed: the next round starts from an empty store, and the space is freed.
                path.unlink()
                store.remove_roots([root.root_id])
                store.collect(pages)
        finally:
            reads.close()
    mib = pages * page_bytes / MIB
    # Medians of the rounds: on a guest that hands its free memory back to its host, one
    # round that meets the slow memory runs at a fifth of the others' rate and would take
    # as long as several of them in a sum (docs/vllm.md). The sums are kept beside.
    per_round = {side: statistics.median(times) for side, times in each.items()}
    total = {side: sum(times) for side, times in each.items()}
    return {
        f"commit_mib_s_{pages}": mib / per_round["commit"],
        f"sequential_write_mib_s_{pages}": mib / per_round["write"],
        f"commit_vs_sequential_{pages}": per_round["write"] / per_round["commit"],
        f"restore_mib_s_{pages}": mib / per_round["restore"],
        f"restore_sync_mib_s_{pages}": mib / per_round["restore_sync"],
        f"sequential_read_mib_s_{pages}": mib / per_round["read"],
        f"restore_vs_sequential_{pages}": per_round["read"] / per_round["restore"],
        f"restore_sync_vs_sequential_{pages}": per_round["read"] / per_round["restore_sync"],
        f"commit_vs_sequential_all_rounds_{pages}": total["write"] / total["commit"],
        f"restore_vs_sequential_all_rounds_{pages}": total["read"] / total["restore"],
        f"restore_slow_rounds_{pages}": slow_rounds(each["restore"]),
        f"sequential_read_slow_rounds_{pages}": slow_rounds(each["read"]),
    }


def slow_rounds(seconds: list[float]) -> int:
    """Rounds that took over twice the median: what the host's slow memory looks like."""
    median = statistics.median(seconds)
    return sum(s > 2 * median for s in seconds)


def bench_victims(work: Path, roots: int, victims: int) -> dict[str, float]:
    store = PageStore(work / "victims", 0, clock=lambda: 2_000_000.0)
    conn = store._wconn
    rng = random.Random(7)
    ids = os.urandom(16 * roots).hex()
    rows = []
    for i in range(roots):
        last = rng.uniform(0, 2_000_000.0)
        rows.append((ids[32 * i : 32 * i + 32], MIB, 1, last, last, last + 300.0))
    # Key order turns the primary-key b-tree inserts into appends; only population speeds up.
    rows.sort()
    conn.execute("PRAGMA cache_size=-262144")
    start = time.perf_counter()
    conn.execute("BEGIN IMMEDIATE")
    conn.executemany("INSERT INTO roots VALUES (?, ?, ?, ?, ?, ?)", rows)
    conn.execute("COMMIT")
    populate_s = time.perf_counter() - start
    conn.execute("ANALYZE")
    samples = []
    for _ in range(20):
        start = time.perf_counter()
        chosen = store.select_victims(victims)
        samples.append(time.perf_counter() - start)
    scans = []
    for _ in range(3):
        start = time.perf_counter()
        scanned = [
            r
            for (r,) in conn.execute(
                "SELECT id FROM roots WHERE +lease_until <= ? "
                "ORDER BY +lease_until, last_access LIMIT ?",
                (2_000_000.0, victims),
            )
        ]
        scans.append(time.perf_counter() - start)
    store.close()
    if scanned != chosen:
        raise RuntimeError("indexed selection and scan-and-sort disagree")
    return {
        "inventory_roots": roots,
        "victims": victims,
        "populate_s": populate_s,
        "victim_select_ms": statistics.median(samples) * 1000,
        "full_scan_sort_ms": statistics.median(scans) * 1000,
    }


def chain(tag: str, n: int) -> list[str]:
    """``n`` keys standing for the chained keys of one sequence ``tag``."""
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).hexdigest() for i in range(n)]


def join_prefix_roots(store: PageStore, keys: list[str]) -> list[tuple]:
    """The prefix roots of ``keys`` by probing every position (what the store avoids)."""
    found: list[tuple] = []
    for start in range(0, len(keys), 500):
        part = list(enumerate(keys))[start : start + 500]
        found += store._wconn.execute(
            f"WITH new(pos, key) AS (VALUES {','.join(['(?, ?)'] * len(part))}) "
            "SELECT r.id FROM new JOIN root_pages rp ON rp.key = new.key AND rp.pos = new.pos "
            "JOIN roots r ON r.id = rp.root_id WHERE r.pages = new.pos + 1",
            [v for pair in part for v in pair],
        ).fetchall()
    return found


def timed_searches(store: PageStore, keys: list[str], label: str) -> dict[str, float]:
    """The store's search for the prefix roots of ``keys`` and the join, checked alike."""
    ours = sorted(r[0] for r in store._prefix_roots(store._wconn, keys))
    if ours != sorted(r[0] for r in join_prefix_roots(store, keys)):
        raise RuntimeError("the prefix search and the join disagree")
    return {
        f"prefix_search_{label}_ms": median_ms(store._prefix_roots, store._wconn, keys),
        f"join_search_{label}_ms": median_ms(join_prefix_roots, store, keys),
    }


def median_ms(fn: Callable[..., object], *args: object, runs: int = 9) -> float:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn(*args)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1000


def bench_sweep(work: Path, files: int) -> dict[str, float]:
    held: list[float] = []
    real_txn = index.write_txn

    @contextlib.contextmanager
    def timed_txn(conn):  # the sweep's transactions, timed from BEGIN to COMMIT
        begun = time.perf_counter()
        with real_txn(conn) as c:
            yield c
        held.append(time.perf_counter() - begun)

    locks, totals, cold = [], [], True
    with PageStore(work / "sweep", 0, durable=False) as store:
        for _ in range(files):
            key = "ab" + os.urandom(15).hex()
            store.commit(make_root(os.urandom(16).hex(), [key], 64))
        recovery.index.write_txn = timed_txn
        try:
            for _ in range(5):
                os.sync()
                try:
                    Path("/proc/sys/vm/drop_caches").write_text("2")
                except OSError:
                    cold = False
                held.clear()
                begun = time.perf_counter()
                store.sweep(["ab"])
                totals.append(time.perf_counter() - begun)
                locks.append(max(held))
        finally:
            recovery.index.write_txn = real_txn
    return {"sweep_files": files, "sweep_cold": cold,
            "sweep_lock_ms": statistics.median(locks) * 1e3,
            "sweep_ms": statistics.median(totals) * 1e3}


def bench_supersede(work: Path, long_pages: int, sharing: int, shared: int) -> dict[str, float]:
    size, result = 64, {}
    with PageStore(work / "long", 0, durable=False) as store:
        keys = chain("long", long_pages + 10)
        store.commit(make_root(os.urandom(16).hex(), keys[:long_pages], size))
        turns = iter([make_root(os.urandom(16).hex(), keys[:n], size)
                      for n in range(long_pages + 1, long_pages + 10)])
        result["commit_long_root_ms"] = median_ms(lambda: store.commit(next(turns)))
        if store.usage().entries != 1:
            raise RuntimeError("the turns of one sequence left more than one root")
        result.update(timed_searches(store, keys, "long"))
    with PageStore(work / "shared", 0, durable=False) as store:
        system = chain("system", shared)
        for i in range(sharing):
            store.commit(make_root(os.urandom(16).hex(), system + chain(f"c{i}", 1), size))
        keys = system + chain("new", 1)
        result.update(timed_searches(store, keys, "shared"))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dir", type=Path, help="directory on the disk to measure")
    parser.add_argument("--pages", type=int, default=512, help="1 MiB pages per side")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds")
    parser.add_argument("--page-kib", type=int, default=512,
                        help="page size of the comparison with the disk's limit")
    parser.add_argument("--seq-rounds", type=int, default=6,
                        help="rounds of 4,096-page publications (64-page: 16x as many)")
    parser.add_argument("--roots", type=int, default=1_000_000, help="victim inventory")
    parser.add_argument("--victims", type=int, default=1000)
    parser.add_argument("--long-pages", type=int, default=20_000)
    parser.add_argument("--sharing", type=int, default=1000)
    parser.add_argument("--shared-pages", type=int, default=200)
    parser.add_argument("--sweep-files", type=int, default=4096,
                        help="objects of the swept fan-out directory")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sparkcache-bench-", dir=args.dir))
    try:
        result = {**bench_io(work, args.pages, args.rounds)}
        page_bytes = args.page_kib * 1024
        result["sequential_page_bytes"] = page_bytes
        for pages, rounds in ((64, 16 * args.seq_rounds), (4096, args.seq_rounds)):
            result.update(bench_vs_sequential(work, page_bytes, pages, rounds))
        for side in ("commit", "restore"):
            result[f"{side}_vs_sequential"] = min(
                result[f"{side}_vs_sequential_{p}"] for p in (64, 4096)
            )
        result.update(bench_victims(work, args.roots, args.victims))
        result.update(bench_supersede(work, args.long_pages, args.sharing, args.shared_pages))
        result.update(bench_sweep(work, args.sweep_files))
    finally:
        shutil.rmtree(work)
    result["guest_reports_free_memory"] = guest_memory.reports_free_memory()
    result = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>20}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
