"""The restore worker of one rank: load ring -> verified pages -> the engine's KV blocks.

Per load: validate every field of its records (a malformed one is dropped, counted by
reason and answered ``malformed``); check that it is addressed to this process (its pid
and start time, from its stats slot): a load meant for another restore worker, a dead
predecessor, is dropped and answered ``stale``, because the client may already have
reported it failed and the engine reused its blocks; open the registration (again when
``reg_gen`` changes) and bounds-check every block id; plan the stored prefix in the
index (read-only: this worker never writes the index); then read and verify the pages in
chunks on a small pool of reader threads, each with its own ``StoreReader``, stopping at
the first page that is missing or fails verification. Several loads are served at once,
a chunk of each in turn (round robin), so a one-page load does not wait behind a load of
gigabytes: each is answered when its own last write is done. Loads that come while
others are served join the turn at the next chunk. A run of a pack's records not in
the page cache is read past it (``sparkcache.store.direct``): into the reader's own
buffers, verified there, then copied to its destination. Where the engine's KV is host
memory (vLLM's CPU backend, its KV moved into shared memory) that destination is the
page's blocks' runs (a cached run is read straight into them from the page cache): one
copy, where staging took two. A page that fails is zeroed before the load is answered,
so no block holds an unverified byte, and the report counts only the verified prefix
(vLLM recomputes every block past it, whatever it holds). On a CUDA device each chunk
goes into page-locked staging, verified, and its verified prefix crosses on this
worker's own stream, synchronised before the report.

The report on ``loaded`` says how many leading pages were written, the status
(``protocol.LoadStatus``) and, for a verification failure, the index and object of the
first bad page (the client asks maintenance to quarantine it: only the client produces
into the request ring). Reports are never dropped while this process lives: the client
reuses a load's blocks only after a report or this process's death (docs/pipeline.md).
One the full ring refuses waits, in order, and no new load is taken meanwhile.

The read-through (docs/fleet.md): where a cluster is configured, the pages of a load past
the local store's prefix are fetched from the fleet's cluster, a chunk a pipeline on a
thread of their own, each verified (``fleet.codec``) before a byte of it is copied to its
blocks; the load ends at the first page missing there or failing verification (vLLM
recomputes from it). The engine's save of the request then stores them locally.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from posix_ipc import SignalError
from sparkcache.shm import RingClosed, RingEmpty, RingFull
from sparkcache.shm.layouts import READ_PATHS, join_keys, split_key
from sparkcache.shm.segment import process_gone
from sparkcache.workers import lifecycle
from sparkcache.workers.batches import split_batches
from sparkcache.workers.lifecycle import ENVIRONMENT_FAULTS, Lifecycle, WorkerSpec

from sparkcache import registry, segments
from sparkcache.config import Config
from sparkcache.fleet.link import ClusterLink, settings_of
from sparkcache.fleet.pages import fetch_into
from sparkcache.protocol import LoadStatus
from sparkcache.ratelog import RateLimitedLog
from sparkcache.store import StoreError, UnsafeStoreDir
from sparkcache.store.direct import IN_FLIGHT, DirectReads
from sparkcache.store.layout import RankLayout
from sparkcache.store.reader import BadObject, PlannedPage, ReadResult, StoreReader

if TYPE_CHECKING:
    import torch

    from sparkcache import kvmem

log = logging.getLogger(__name__)

POLL_S = 0.2
LOAD_CAPACITY = segments.RINGS["load"][1]  # also the most pages of one load
# Reader threads: file reads and CRC-32C release the GIL, so a reader runs beside the
# writes into blocks (which the main thread does, in order). Two: a reader reads a pack's
# records past the page cache with many requests in flight (sparkcache.store.direct), and
# while one verifies and copies its chunk the other's requests keep the disk busy. (Read
# through the page cache, one reader did better: two made two streams for the kernel's
# readahead; docs/store.md, "Reading a pack".) Each holds 34 MiB of buffers for it.
READERS = 2
# Threads fetching chunks from the fleet's cluster (the read-through): redis-py's cluster
# client serves each from its own connection per node.
FETCHERS = 2
# Bytes read per task; the staging holds STAGED_CHUNKS of them (read ahead of the writes).
CHUNK_BYTES = 16 << 20
STAGED_CHUNKS = 2 * READERS
# A load's pages are planned (their index rows read) this many at a time, at least a
# chunk's, as its reads reach them: its first chunks are read while the rest is planned.
# Planned whole, a load of 3,750 pages waited 20-50 ms before its first read, two loads
# arriving together twice that (scripts/bench_mission.py, profiled).
PLAN_PAGES = 1024
# A reader's index connection may wait this long for a lock (the engine's waits 5 ms).
READER_BUSY_MS = 1000
# How often an idle worker looks for a registration to open ahead of its first load.
WARM_CHECK_S = 1.0
# Read-ahead after a start (``read_ahead_bytes``): bytes asked of the kernel per idle step.
# A load that arrives then finds at most this much queued ahead of its own reads on the
# disk; with idle steps POLL_S apart it reads ahead at up to ~160 MiB/s.
READ_AHEAD_SLICE_BYTES = 32 << 20
# Opening a registration (a CUDA context) beats for at most this long.
SLOW_OPEN_S = 60.0
# A chunk read for longer than this stops the heartbeat: a disk that hangs then shows as
# a hung worker, which the supervisor restarts, ending the loads sent to it (the client
# releases their blocks once the process is gone), not a worker beating on while every
# load waits behind the stuck one.
STUCK_READ_S = 60.0
_UNIFORM = ("load_id", "reg_gen", "npages", "worker_pid", "worker_start")


def split_loads(batch: np.ndarray, capacity: int) -> list[tuple[np.ndarray, str | None]]:
    """The loads in a popped batch, each with the reason it is malformed or None
    (``workers.batches.split_batches``)."""
    return split_batches(batch, capacity, _UNIFORM)


@dataclass
class _Registered:
    reg_gen: int
    opened: kvmem.OpenedTensors
    views: kvmem.BlockViews
    # STAGED_CHUNKS buffers of chunk_pages x page_bytes; none where the pages are read
    # straight into the blocks (``in_place``)
    staging: list[np.ndarray]
    chunk_pages: int
    stream: torch.cuda.Stream | None  # this worker's own, on a CUDA device
    owner: tuple[float, float] | None  # the registering engine's pid and start time
    ipc_ref_files: list[str]  # torch's, for CUDA tensors (registry.ipc_ref_files)

    @property
    def in_place(self) -> bool:
        """Pages are read into the blocks themselves (host tensors: ``host_runs``)."""
        return self.views.host_runs


@dataclass
class _Outcome:
    status: LoadStatus
    pages: int = 0
    bad_index: int = -1
    bad: BadObject | None = None

    def record(self, load_id: int) -> tuple:
        hi = lo = gen = 0
        if self.bad is not None:
            hi, lo = split_key(self.bad.key)
            gen = int(self.bad.generation, 16)
        return (load_id, int(self.status), self.pages, self.bad_index, 0, hi, lo, gen)


@dataclass(frozen=True)
class _ClusterPage:
    """A page of a load past the local store's prefix, to fetch from the cluster."""

    key: str  # hex


@dataclass(frozen=True)
class _Fetched(ReadResult):
    cluster_bytes: int = 0
    bad_pages: int = 0  # fetched pages that failed verification (0 or 1: it ends there)


@dataclass
class _Active:
    """A load being served: its plan read chunk by chunk, in turn with the others."""

    load_id: int
    keys: list[str]  # the pages asked for
    blocks: list[int]
    started: float  # perf_counter
    # The stored prefix of them as far as planned, then (read-through) the rest, to fetch
    # from the cluster.
    plan: list[PlannedPage | _ClusterPage] = field(default_factory=list)
    local: int = 0  # leading pages of the plan in the local store
    planned: bool = False  # the plan is whole: it reached the last key or its end
    submitted: int = 0  # leading pages of the plan handed to the readers
    written: int = 0  # leading pages verified and written into their blocks
    reading: int = 0  # its chunks with the readers
    outcome: _Outcome | None = None  # set when it ended before its plan did


class _ReaderPool:
    """Threads that read and verify planned pages into staging or blocks, each through its
    own ``StoreReader`` (an index connection belongs to the thread that opened it; it is
    used only to look up a file found missing)."""

    def __init__(self, open_reader: Callable[[DirectReads], StoreReader],
                 threads: int) -> None:
        # The requests of every reader's direct reads (sparkcache.store.direct).
        self._io = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="restore-io")
        self._open = lambda: open_reader(DirectReads(self._io))
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._run, name=f"restore-read-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        reader: StoreReader | None = None
        try:
            # Opened now, while the worker is idle, not in the first load's time (the
            # first load after a restart was 1.5x the others': scripts/bench_restart.py).
            # One that fails is opened again at the first job, which reports the error.
            with contextlib.suppress(Exception):
                reader = self._open()
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                fut, pages, rows = job
                # Held no longer than the job: rows may be views of a registration's
                # KV, whose mapping goes only once no view of it is left.
                job = None
                if fut.set_running_or_notify_cancel():
                    try:
                        if reader is None:
                            reader = self._open()
                        fut.set_result(reader.read_planned(pages, rows))
                    except BaseException as exc:  # handed to the waiting thread
                        fut.set_exception(exc)
                fut = pages = rows = None
        finally:
            if reader is not None:
                reader.close()

    def submit(self, pages: Sequence[PlannedPage], rows: np.ndarray) -> Future:
        fut: Future = Future()
        self._jobs.put((fut, pages, rows))
        return fut

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join()
        self._io.shutdown()


class _FleetFetcher:
    """Fetches the pages of loads the local store lacks from the fleet's cluster, a chunk
    a pipeline, on threads of their own beside the readers (``FETCHERS``: one chunk's
    round trip overlaps another's verification and copy). A cluster that fails ends the
    chunk's load there (a miss) and is not asked again for a back-off
    (``ClusterLink``)."""

    def __init__(self, cfg: Config, rank: int) -> None:
        self.rank = rank
        self.link = ClusterLink(settings_of(cfg), f"restore[r{rank}] read-through")
        self._pool = ThreadPoolExecutor(FETCHERS, thread_name_prefix="restore-fleet")

    def submit(self, pages: Sequence[_ClusterPage], into: Sequence[object],
               page_bytes: int) -> Future:
        return self._pool.submit(self._fetch, [bytes.fromhex(p.key) for p in pages], into,
                                 page_bytes)

    def _fetch(self, keys: list[bytes], into: Sequence[object], page_bytes: int) -> _Fetched:
        prefix = self.link.settings.key_prefix
        got = self.link.call(
            lambda cluster: fetch_into(cluster, prefix, self.rank, keys, into, page_bytes))
        if got is None:  # backing off, or the cluster failed: the load ends here
            return _Fetched(0, ())
        return _Fetched(got.pages, (), cluster_bytes=got.bytes,
                        bad_pages=int(got.bad is not None))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.link.close()


class Restore:
    def __init__(self, life: Lifecycle) -> None:
        spec = life.spec
        self.life = life
        self.cfg = spec.cfg
        self.rank = spec.rank
        self.me = (os.getpid(), life.pid_start)
        self.loads = segments.consumer(self.cfg, spec.rank, "load")
        self.loaded = segments.producer(self.cfg, spec.rank, "loaded")
        self.layout = RankLayout(self.cfg.store_dir, spec.rank)
        self.reg: _Registered | None = None
        self._reader: StoreReader | None = None
        self._pool: _ReaderPool | None = None
        self._fleet = _FleetFetcher(self.cfg, spec.rank) if self.cfg.read_through else None
        life.report["fleet_bad_pages"] = 0
        self._unsent: deque[tuple] = deque()
        # Loads popped and not yet planned, in the order they came.
        self._popped: deque[np.ndarray] = deque()
        self._active: list[_Active] = []  # planned, not yet answered
        self._turn: deque[_Active] = deque()  # those with chunks left to read, in turn
        # Chunks handed to the readers, in the order they were: (load, first page,
        # staging token, future).
        self._reading: deque[tuple[_Active, int, int, Future]] = deque()
        # Staging tokens: a staging buffer each, or (read in place) only the bound on
        # the chunks read ahead.
        self._free = list(range(STAGED_CHUNKS))
        life.report.update((f"read_bytes_{path}", 0) for path in READ_PATHS)
        self._rare = RateLimitedLog(log)
        self._warm_at = 0.0
        self._warmed: int | None = None  # the registration the last warm-up opened
        # Pages still to read ahead (``_read_ahead``); None until planned.
        self._ahead: deque[PlannedPage] | None = None
        self._ahead_started = 0.0
        # torch before READY, as capture does, where the start-up limit (60 s) covers it:
        # imported by a first load, it held the GIL (and so the heartbeat) for over 10 s
        # on a cold page cache beside a vLLM server, and the supervisor killed the worker.
        _kvmem()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
        if self._fleet is not None:
            self._fleet.close()
        if self._reader is not None:
            self._reader.close()
        self._close_registration()
        self.loads.close()
        self.loaded.detach()

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        self.life.serve(self._step, POLL_S)
        # Loads already queued are still done: their blocks are held until answered.
        while self._take(0):
            self.life.beat()
        # Whatever the ring still refuses is not waited for: the client reports a load
        # of a worker that is gone as failed, and reuses its blocks only then.
        self._flush()
        if self._unsent:
            log.warning("%d load reports not delivered (the client reports those loads "
                        "failed once this process is gone)", len(self._unsent))

    def _step(self, timeout: float) -> None:
        if not self._flush():
            self.life.idle(min(timeout, 0.01))  # reports wait: take no new load
            return
        if not self._take(timeout):
            try:
                self._warm()
                self._read_ahead()
            except ENVIRONMENT_FAULTS:
                raise
            except Exception as exc:
                # Work ahead of loads, not theirs: a fault here must not stop the worker
                # (a load meeting the same fault fails alone). No more read-ahead.
                self._rare.warning("idle", "idle work failed, read-ahead given up: %r", exc)
                self._ahead = deque()

    def _warm(self) -> None:
        """Idle: open the engine's registration, and the index readers, before the first
        load needs them. On a CUDA device opening makes a CUDA context (seconds); on the
        CPU it maps every page of the KV segment (``kvmem.open_tensors``, 0.044 s a GiB
        here), which the first load after an engine or worker restart paid inside its
        TTFT, and a fresh worker's first reads open the readers' index connections. Only
        while the registering engine lives: a dead one's segment is not kept mapped."""
        now = time.monotonic()
        if now < self._warm_at:
            return
        self._warm_at = now + WARM_CHECK_S
        if self.reg is not None and self.reg.owner is not None and process_gone(*self.reg.owner):
            # Its engine is gone: the KV segment, unlinked, lives on only while mapped
            # here, and a restarted engine needs as much /dev/shm again for its own.
            log.info("registration %d: its engine is gone; its KV unmapped", self.reg.reg_gen)
            gone, pid = self.reg.ipc_ref_files, int(self.reg.owner[0])
            self._close_registration()
            registry.unlink_ipc_files(gone, pid)
        desc = registry.read_registry(self.cfg.store_dir, self.rank)
        if desc is None:
            return
        reg_gen = desc.get("reg_gen")
        if reg_gen == self._warmed or not isinstance(reg_gen, int):
            return
        # Looked at once: a registration that fails is a load's error, and a dead engine
        # does not come back (its segment is not worth mapping).
        self._warmed = reg_gen
        owner = registry.registration_owner(desc)
        if owner is None:
            return
        if process_gone(*owner):
            registry.unlink_ipc_files(registry.ipc_ref_files(desc), int(owner[0]))
            return
        if self._registration(reg_gen) is not None:
            self._store()

    def _read_ahead(self) -> None:
        """Idle: ask the kernel to read the most recently used roots' pages into the page
        cache (``read_ahead_bytes`` of them, newest root first), a slice per idle step, so
        the first turns after a restart or a reboot do not wait for the disk. Measured
        beside vLLM: a restarted engine's first turn at 16k loaded in 0.149 s, the same
        turn again 0.067 s, the difference 9 MiB per turn read from the disk, evicted from
        the page cache in the minutes between (docs/benchmarks.md). Only hints: nothing
        is copied here, and a load waits behind at most one slice of reads."""
        if self._ahead is None:
            if not self.cfg.read_ahead_bytes:
                self._ahead = deque()
                return
            reader = self._store()
            if reader is None:
                return  # no store yet: planned at a later idle step
            self._ahead = deque(reader.recent_pages(self.cfg.read_ahead_bytes))
            self._ahead_started = time.monotonic()
        if not self._ahead:
            return
        slice_: list[PlannedPage] = []
        size = 0
        while self._ahead and size < READ_AHEAD_SLICE_BYTES:
            page = self._ahead.popleft()
            slice_.append(page)
            size += page.size
        assert self._reader is not None
        self.life.prefaulted_bytes += self._reader.read_ahead(slice_)
        if not self._ahead:
            log.info("read ahead %.1f MiB of the most recently used roots in %.1f s",
                     self.life.prefaulted_bytes / 2**20,
                     time.monotonic() - self._ahead_started)

    def _flush(self) -> bool:
        """Push the reports the ring refused before, in order; True once none waits."""
        while self._unsent:
            try:
                self.loaded.try_push(self._unsent[0])
            except RingFull:
                return False
            self._unsent.popleft()
        return True

    def _answer(self, load_id: int, outcome: _Outcome) -> None:
        self._unsent.append(outcome.record(load_id))
        self._flush()

    def _take(self, timeout: float) -> bool:
        """Do the loads waiting in the ring, and those that come while they are served, to
        their end; False when there were none."""
        if not self._pop(timeout):
            return False
        while self._popped or self._active:
            t0 = time.perf_counter()
            self._serve_chunk()
            self.life.copy_seconds += time.perf_counter() - t0
            # Loads that came meanwhile join the turn at once, not after these end; none
            # while reports wait for room.
            if self._flush():
                self._pop(0)
        return True

    def _pop(self, timeout: float) -> bool:
        """Take the loads waiting in the ring: malformed ones and those meant for another
        process are answered at once, the rest wait in ``_popped``. False if none came."""
        try:
            batch = self.loads.pop_batch(LOAD_CAPACITY, timeout=timeout)
        except (RingEmpty, RingClosed, SignalError):
            return False
        lifecycle.checkpoint("restore.popped")
        for recs, malformed in split_loads(batch, LOAD_CAPACITY):
            load_id = int(recs["load_id"][0])
            if malformed is not None:
                self.life.drop(malformed, f"load {load_id} ({len(recs)} records)")
                # Every load among the records is answered: one whose framing broke can
                # run into the next, and an unanswered load holds its blocks.
                for other in dict.fromkeys(recs["load_id"][1:].tolist()):
                    if other != load_id:
                        self._end(int(other), _Outcome(LoadStatus.MALFORMED))
                self._end(load_id, _Outcome(LoadStatus.MALFORMED))
            elif (int(recs["worker_pid"][0]), float(recs["worker_start"][0])) != self.me:
                # Meant for a predecessor: its client may have reported it failed when that
                # process died, and the engine may be using the blocks again.
                self.life.drop("stale", f"load {load_id} for pid {int(recs['worker_pid'][0])}")
                self._end(load_id, _Outcome(LoadStatus.STALE))
            else:
                self._popped.append(recs)
        return True

    def _end(self, load_id: int, outcome: _Outcome, seconds: float | None = None) -> None:
        """Count a load's end (``seconds``: how long it was served) and answer it."""
        if seconds is not None:
            self.life.timed(seconds)
        self.life.outcome(int(outcome.status))
        if outcome.status in (LoadStatus.OK, LoadStatus.PARTIAL):
            self.life.processed += 1
        else:
            self.life.failed += 1
        self._answer(load_id, outcome)
        lifecycle.checkpoint("restore.answered")

    def _serve_chunk(self) -> None:
        """Start the loads popped, hand chunks to the readers in turn, one of each load
        with pages left (round robin), and write the oldest chunk read into its blocks."""
        self._start_popped()
        self._submit_in_turn()
        if self._reading:
            self._complete(*self._reading.popleft())

    def _start_popped(self) -> None:
        """Plan the popped loads; one of another registration than the loads being served
        waits for them to end (opening it closes theirs). New loads take their first turn
        before the loads already served take their next: a short load then ends within a
        few chunks of its arrival."""
        new: list[_Active] = []
        while self._popped:
            recs = self._popped[0]
            if self._active and self.reg is not None and \
                    int(recs["reg_gen"][0]) != self.reg.reg_gen:
                break
            self._popped.popleft()
            load_id = int(recs["load_id"][0])
            t0 = time.perf_counter()
            try:
                started = self._start(recs)
            except ENVIRONMENT_FAULTS:
                raise
            except Exception:
                self.life.item_error("load", load_id)
                self._check_usable()
                started = _Outcome(LoadStatus.FAILED)
            if isinstance(started, _Outcome):
                self._end(load_id, started, time.perf_counter() - t0)
            else:
                self._active.append(started)
                if started.plan:
                    new.append(started)
                self._finish_if_done(started)
        self._turn.extendleft(reversed(new))

    def _start(self, recs: np.ndarray) -> _Active | _Outcome:
        """The load, its first pages planned, or why it ends without a plan."""
        reg = self._registration(int(recs["reg_gen"][0]))
        if reg is None:
            return _Outcome(LoadStatus.UNREGISTERED)
        blocks = recs["block_id"]
        if (blocks < 0).any() or (blocks >= reg.views.num_blocks).any():
            self.life.drop("block", f"load with block ids outside "
                           f"0-{reg.views.num_blocks - 1}")
            return _Outcome(LoadStatus.BAD_BLOCK)
        reader = self._store()
        if reader is None:
            return _Outcome(LoadStatus.PARTIAL)
        keys = join_keys(recs["key_hi"], recs["key_lo"])
        load = _Active(int(recs["load_id"][0]), keys, blocks.tolist(), time.perf_counter())
        self._plan_more(load, reader, reg)
        return load

    def _plan_more(self, load: _Active, reader: StoreReader, reg: _Registered) -> None:
        """Plan ``load``'s next pages (``PLAN_PAGES``, at least a chunk's) from the local
        store. Its plan is whole at the first page the store lacks, and then, with a
        read-through, the rest are the cluster's."""
        start = load.local
        step = load.keys[start : start + max(PLAN_PAGES, reg.chunk_pages)]
        plan = reader.plan(step)
        # A page of another size than the engine's is not its page (a staging row would
        # also keep an earlier page's bytes past it): the load ends before it.
        fits = next((i for i, p in enumerate(plan) if p.size != reg.views.page_bytes),
                    len(plan))
        if fits < len(plan):
            self._rare.warning("size", "page %s holds %d bytes, not the engine's %d; "
                               "the load ends there", plan[fits].key, plan[fits].size,
                               reg.views.page_bytes)
        load.plan += plan[:fits]
        load.local += fits
        if fits == len(step) and load.local < len(load.keys):
            return  # more to plan
        load.planned = True
        if self._fleet is not None and fits == len(plan) and load.local < len(load.keys):
            load.plan += [_ClusterPage(k) for k in load.keys[load.local :]]  # read-through

    def _submit_in_turn(self) -> None:
        """Hand the readers a chunk of each load in turn while staging is free (up to
        STAGED_CHUNKS read ahead of the writes, across loads)."""
        reg = self.reg
        if not self._turn:
            return  # (and reg may be None: every load popped ended at its start)
        assert self._pool is not None and reg is not None
        size = reg.chunk_pages
        while self._free and self._turn:
            load = self._turn.popleft()
            if not load.planned and load.submitted + size > len(load.plan):
                self._plan_next(load, reg)
            start = load.submitted
            if start == len(load.plan):  # its plan ended where its reads had
                self._finish_if_done(load)
                continue
            # A chunk is all local pages or all the cluster's.
            end = min(start + size, load.local) if start < load.local else start + size
            pages = load.plan[start:end]
            load.submitted += len(pages)
            buf = self._free.pop()
            into = reg.staging[buf] if not reg.in_place else [
                reg.views.page_runs(b) for b in load.blocks[start : start + len(pages)]]
            if start < load.local:
                fut = self._pool.submit(pages, into)  # type: ignore[arg-type]
            else:
                assert self._fleet is not None
                fut = self._fleet.submit(pages, into,  # type: ignore[arg-type]
                                         reg.views.page_bytes)
            load.reading += 1
            self._reading.append((load, start, buf, fut))
            if load.submitted < len(load.plan) or not load.planned:
                self._turn.append(load)

    def _plan_next(self, load: _Active, reg: _Registered) -> None:
        """``_plan_more`` as the load's reads reach its plan's end; a fault ends the plan
        where it is (the pages planned are read, the rest are a miss)."""
        try:
            assert self._reader is not None
            self._plan_more(load, self._reader, reg)
        except ENVIRONMENT_FAULTS:
            raise
        except Exception:
            self.life.item_error("load", load.load_id)
            self._check_usable()
            load.planned = True

    def _complete(self, load: _Active, start: int, buf: int, fut: Future) -> None:
        """Write a chunk's verified prefix into its load's blocks (read in place: it is
        there already); the load ends at the first page that could not be read or
        verified, or with its last chunk."""
        reg = self.reg
        assert reg is not None
        try:
            result: ReadResult = self._wait(fut, quiet=load.outcome is not None)
            if load.outcome is None:
                self._write(reg, load, start, buf, result)
        except ENVIRONMENT_FAULTS:
            raise
        except Exception:
            self.life.item_error("load", load.load_id)
            self._check_usable()
            self._stop(load, _Outcome(LoadStatus.FAILED))
        finally:
            self._free.append(buf)
            load.reading -= 1
        self._finish_if_done(load)

    def _write(self, reg: _Registered, load: _Active, start: int, buf: int,
               result: ReadResult) -> None:
        if result.pages:
            if not reg.in_place:
                reg.views.scatter_pages(load.blocks[start : start + result.pages],
                                        reg.staging[buf][: result.pages], reg.stream)
            load.written += result.pages
            self.life.copy_bytes += result.pages * reg.views.page_bytes
            for path in READ_PATHS:
                self.life.report[f"read_bytes_{path}"] += getattr(result, f"{path}_bytes", 0)
            lifecycle.checkpoint("restore.written")
        if isinstance(result, _Fetched):
            self.life.report["fleet_bad_pages"] += result.bad_pages
        if result.pages < len(load.plan[start : start + reg.chunk_pages]):
            # The page it stopped at; pages opened ahead of it may be reported too.
            stop = load.plan[start + result.pages].key
            bad = next((b for b in result.bad if b.key == stop), None)
            self._stop(load, _Outcome(LoadStatus.PARTIAL, load.written) if bad is None
                       else _Outcome(LoadStatus.CORRUPT, load.written, load.written, bad))

    def _stop(self, load: _Active, outcome: _Outcome) -> None:
        """End ``load`` early: no more of its chunks are read; those the readers have
        begun are waited for (nothing may read into its blocks, or into staging another
        load takes, once it is answered)."""
        load.outcome = outcome
        with contextlib.suppress(ValueError):
            self._turn.remove(load)
        for entry in [e for e in self._reading if e[0] is load and e[3].cancel()]:
            self._reading.remove(entry)
            self._free.append(entry[2])
            load.reading -= 1

    def _finish_if_done(self, load: _Active) -> None:
        """Answer ``load`` once its last chunk is written (or it ended) and none of its
        chunks is still being read."""
        if load.reading or (load.outcome is None and (
                load.submitted < len(load.plan) or not load.planned)):
            return
        outcome = load.outcome or _Outcome(
            LoadStatus.OK if load.written == len(load.keys) else LoadStatus.PARTIAL,
            load.written)
        self._active.remove(load)
        self._end(load.load_id, outcome, time.perf_counter() - load.started)

    def _check_usable(self) -> None:
        """StoreError (an environment fault: exit 4) if the store's directories are gone
        or unsafe."""
        try:
            self.layout.prepare(create=False)
        except OSError as exc:
            raise StoreError(f"store {self.layout.rank_dir} is unusable: {exc}") from exc

    # ------------------------------------------------------------------ one load

    def _open_reader(self, direct: DirectReads | None = None) -> StoreReader:
        reader = StoreReader(self.cfg.store_dir, self.rank, direct=direct)
        # Not the engine: a reader may wait a little for SQLite's rare exclusive moments.
        reader.conn.execute(f"PRAGMA busy_timeout={READER_BUSY_MS}")
        return reader

    def _store(self) -> StoreReader | None:
        """The index reader, opened on first use; None while the store does not exist
        yet (maintenance creates it as it starts)."""
        if self._reader is None:
            try:
                self._reader = self._open_reader()
            except UnsafeStoreDir:
                raise  # an environment fault: exit 4
            except (OSError, StoreError) as exc:
                # Not made yet (no directory, gate or index), or half made: a miss.
                self._rare.warning("store", "store not readable (yet?): %s; loads miss", exc)
                return None
            self._pool = _ReaderPool(self._open_reader, READERS)
        return self._reader

    def _close_registration(self) -> None:
        if self.reg is not None:
            self.reg.staging = []
            self.reg.opened.close()
            self.reg = None

    def _registration(self, reg_gen: int) -> _Registered | None:
        if self.reg is not None and self.reg.reg_gen == reg_gen:
            return self.reg
        desc = registry.read_registry(self.cfg.store_dir, self.rank)
        if desc is None or desc.get("reg_gen") != reg_gen:
            return None
        self._close_registration()
        try:
            self.reg = self._beating(lambda: _open_registration(desc, reg_gen))
        except Exception:
            # The engine's registration, not this worker's environment: this load fails,
            # and the next registration may be fine.
            self.life.item_error("registration", reg_gen)
            return None
        return self.reg

    def _beating(self, fn: Callable[[], _Registered]) -> _Registered:
        """``fn()`` on a helper thread while this one beats, for up to ``SLOW_OPEN_S``:
        the first CUDA registration creates a CUDA context, seconds of
        work in one call with no checkpoint inside, which the supervisor's heartbeat
        limit (1 s at the least) must not take for a hang. One that takes longer than
        SLOW_OPEN_S is left to that limit."""
        box: dict[str, object] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # re-raised in the calling thread
                box["error"] = exc

        helper = threading.Thread(target=run, name="restore-open", daemon=True)
        helper.start()
        until = time.monotonic() + SLOW_OPEN_S
        while helper.is_alive():
            helper.join(lifecycle.PROGRESS_BEAT_S / 2)
            if time.monotonic() < until:
                self.life.progress()
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["value"]  # type: ignore[return-value]

    def _wait(self, fut: Future, quiet: bool = False) -> ReadResult:
        """The chunk's result, beating while a slow disk keeps it coming, for up to
        ``STUCK_READ_S``."""
        until = time.monotonic() + STUCK_READ_S
        while True:
            try:
                return fut.result(timeout=lifecycle.PROGRESS_BEAT_S)
            except TimeoutError:
                if time.monotonic() < until:
                    self.life.progress()
            except Exception:
                if quiet:
                    return ReadResult(0, ())
                raise


def _open_registration(desc: dict, reg_gen: int) -> _Registered:
    """Open the registered tensors, their block views, staging and (on a CUDA device)
    this worker's own stream."""
    kvmem, torch = _kvmem()
    opened = kvmem.open_tensors(desc)
    try:
        views = kvmem.BlockViews(opened.tensors, int(desc["block_dim"]))
        chunk = max(1, CHUNK_BYTES // views.page_bytes)
        cuda = views.tensors[0].is_cuda
        # Host tensors (the CPU backend's KV, in shared memory) are read into in place.
        staging = [] if views.host_runs else [
            _staging(chunk, views.page_bytes, pinned=cuda) for _ in range(STAGED_CHUNKS)]
        stream = torch.cuda.Stream(device=views.tensors[0].device) if cuda else None
    except BaseException:
        opened.close()
        raise
    return _Registered(reg_gen, opened, views, staging, chunk, stream,
                       registry.registration_owner(desc), registry.ipc_ref_files(desc))


def _kvmem() -> tuple:
    """kvmem and torch (imported as the worker starts, see ``Restore.__init__``)."""
    import torch

    from sparkcache import kvmem

    torch.set_num_threads(1)  # its own pinned cores: no torch thread pool beside the readers
    return kvmem, torch


def _staging(pages: int, page_bytes: int, pinned: bool) -> np.ndarray:
    """A chunk's staging rows; page-locked for a CUDA device (the copy to it then runs
    asynchronously on the worker's stream, at full rate)."""
    if pinned:
        _, torch = _kvmem()
        return torch.empty((pages, page_bytes), dtype=torch.uint8, pin_memory=True).numpy()
    rows = np.empty((pages, page_bytes), np.uint8)
    rows.fill(0)  # faulted in now, while the registration is opened idle, not in a load
    return rows


def _body(life: Lifecycle) -> None:
    worker = Restore(life)
    try:
        worker.run()
    finally:
        worker.close()


def run(spec: WorkerSpec) -> None:
    lifecycle.main(spec, _body)
