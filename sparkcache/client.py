"""``SparkCacheClient``: the engine-side half of SparkCache, inside the vLLM worker.

It never blocks and never raises into the serving path: every public method catches
store and shared-memory faults (a ring closed, missing or corrupt included) and turns
them into a miss or a skipped publication, counted by reason in ``counters``.
Publications go to the capture worker as page descriptors (block id + page key; never
byte ranges). Two acknowledgements come back:

* ``poll_completions``: the blocks of a publication may be reused (capture copied them,
  refused the publication, or its deadline passed). Capture checks the same deadline
  (``time.monotonic`` is one clock for every process of the host) after copying and
  drops a copy that finished late, so a block the engine reuses is never stored under an
  old key.
* ``poll_durable``: a captured publication's root is durable (commit's index transaction
  is done) or failed, with a reason. Only this says the store holds it.

The read side opens the index read-only (``StoreReader``) and writes nothing: the lease
a lookup takes, the access a restore records and the quarantine of a corrupt object it
finds are requests to the maintenance worker.

``load`` hands a restore to the rank's restore worker, which reads, verifies and writes
the pages into the blocks while the engine serves; a load the load ring or ``MAX_LOADS``
has no room for waits in the client's queue until ``poll_loads`` hands it over (room is
never a reason to refuse one), and a load larger than ``PART_PAGES`` goes in parts, one
after the other. ``poll_loads`` reports each load once
the worker writes nothing more into its blocks: it answered, or it is known dead (its
process gone, never only silent). Each load is addressed to the worker process the stats
block names, and any other process refuses it (``stale``), so a restarted worker never
writes into blocks whose load was already reported. ``restore`` is the synchronous form,
in the engine's own thread.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import os
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sparkcache import attachment, kvmem, runtime, segments
from sparkcache.config import AccessMode, Config
from sparkcache.engine_stats import SLOT_CLIENT, EngineStatsWriter, by_reason
from sparkcache.identity import KeyExtras, Namespace, key_halves, sequence_keys, split_keys
from sparkcache.protocol import (
    CaptureStatus,
    DurableStatus,
    LoadStatus,
    RequestKind,
    release_seconds,
    status_name,
    worker_alive,
)
from sparkcache.ratelog import RateLimitedLog
from sparkcache.shm import FREE, Producer, RingEmpty, RingFull
from sparkcache.shm.layouts import (
    LOAD,
    LOAD_MISS_REASONS,
    LOAD_RESULTS,
    LOOKUP_MISS_REASONS,
    PUBLISH,
    SKIP_REASONS,
    join_key,
    split_key,
)
from sparkcache.shm.segment import process_gone, process_start
from sparkcache.store.reader import StoreReader
from sparkcache.workers.lifecycle import Role

log = logging.getLogger(__name__)

RECONNECT_INTERVAL_S = 1.0
# How long capture's liveness and the store's used bytes, read from the workers' stats,
# are trusted by publications. The reports change at beat pace (``PROGRESS_BEAT_S``,
# 0.5 s) or once a maintenance slice, so a stale answer costs little: for at most this
# long, publications go to a capture that has just died (their blocks come back at their
# deadline, as for any publication capture does not take), or past the hard cap, whose
# used bytes maintenance reports a slice late anyway. Read every 0.05 s, the health read
# (two stats records, 43-85 µs on the engine thread's cold caches) was in 4 of the 10
# slowest worker steps of scripts/bench_connector.py.
HEALTH_CACHE_S = 0.25
# A captured publication whose durability commit has not reported after this long is
# reported failed ("no_answer"): commit died with it and no successor redid it, or the
# durable ring was full.
DURABLE_TIMEOUT_S = 120.0
SETTLED_KEPT = 65536
# Publications released by their deadline whose late completion is still taken.
EXPIRED_KEPT = 1024
# Loads (parts of loads) handed to the restore worker and not yet answered; fewer than
# the loaded ring holds, so the worker's reports never wait for room while the engine
# polls. More wait in the client's queue.
MAX_LOADS = 256
# The most pages handed to the restore worker as one part of a load: a larger load goes
# in parts, each once the one before it ended whole, so that no load is too large for the
# load ring and several loads fit in it at once.
PART_PAGES = segments.RINGS["load"][1] // 4
# How often poll_loads looks whether the restore worker of a load in flight is gone:
# psutil reads /proc twice (~0.3 ms), which at 0.1 s was the engine step's slowest call
# once in ~50 steps; a dead worker's loads are rare and a supervisor restart is slower.
LOAD_REAP_S = 0.5
# How long the restore worker's identity (from its stats report) is trusted for loads and
# for the reaper. A load addressed to a worker that has just died is reported
# "worker_gone" by the reaper and recomputed; a stats read per load costs more than the
# rest of it.
RESTORE_CACHE_S = 0.25
# The page indexes of a batch's records, sliced for each batch rather than made for it.
_PAGE_INDEX = np.arange(max(segments.RINGS["publish"][1], segments.RINGS["load"][1]),
                        dtype=np.uint32)
_PAGE_INDEX.flags.writeable = False
_PUBLISH_SHARED = PUBLISH.shared("pub_id", "root_hi", "root_lo", "deadline", "reg_gen", "npages")
# The key a release carries: it names its lease by id alone.
_NO_KEY = "0" * 32
_LOAD_SHARED = LOAD.shared("load_id", "worker_start", "worker_pid", "reg_gen", "npages")


@dataclass
class ClientCounters:
    """Process-local counters; ``skipped``, ``misses`` and the failures by reason."""

    published: int = 0
    pages_published: int = 0
    completed: int = 0
    capture_failed: Counter = field(default_factory=Counter)
    released_by_deadline: int = 0
    durable: int = 0
    not_durable: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)
    lookups: int = 0
    lookup_tokens: int = 0  # tokens the lookups asked about
    hit_tokens: int = 0  # tokens they found
    lookup_misses: Counter = field(default_factory=Counter)  # also in ``misses``
    unleased_lookups: int = 0  # counted with no supervisor running (nothing evicts then)
    restored_pages: int = 0
    misses: Counter = field(default_factory=Counter)
    requests_dropped: int = 0
    ring_errors: int = 0
    loads: int = 0  # taken for the restore worker (at once, or through the queue)
    loaded_pages: int = 0  # written into blocks by it
    load_status: Counter = field(default_factory=Counter)  # reported loads, by status
    # Publications that waited for room in the publish ring (taken all the same).
    publications_queued: int = 0
    # Loads (and later parts of large ones) that waited in the queue for room (the ring,
    # MAX_LOADS), and how long, summed.
    loads_queued: int = 0
    load_queue_seconds: float = 0.0
    load_queue_depth: int = 0  # a gauge: loads waiting in the queue now

    def fields(self) -> dict[str, float]:
        """This client's record in the rank's engine stats block (``ENGINE_STATS``)."""
        # ``misses`` counts every miss; those of lookups are also in ``lookup_misses``, and
        # the rest are the read side's (loads and synchronous restores).
        looked = self.lookup_misses
        read_misses = {reason: n - looked.get(reason, 0) for reason, n in self.misses.items()}
        return {
            "lookups": self.lookups,
            "lookup_tokens": self.lookup_tokens,
            "lookup_hit_tokens": self.hit_tokens,
            **by_reason("lookup_miss_", self.lookup_misses, LOOKUP_MISS_REASONS),
            "publications": self.published,
            "published_pages": self.pages_published,
            **by_reason("skip_", self.skipped, SKIP_REASONS),
            "expired": self.released_by_deadline,
            "loads": self.loads,
            **by_reason("load_", self.load_status, LOAD_RESULTS),
            "loaded_pages": self.loaded_pages,
            "restored_pages": self.restored_pages,
            **by_reason("load_miss_", read_misses, LOAD_MISS_REASONS),
            "checksum_failures": self.misses["corrupt"],
            "requests_dropped": self.requests_dropped,
            "ring_errors": self.ring_errors,
            "loads_queued": self.loads_queued,
            "load_queue_seconds": self.load_queue_seconds,
            "load_queue_depth": self.load_queue_depth,
        }


@dataclass(frozen=True)
class Completion:
    """A publication the engine is done with: its blocks may be reused."""

    seq_id: str | int
    blocks: list[int]
    status: str  # "captured" (on to commit), "expired", or why capture refused it
    pages_copied: int = 0  # captured: pages copied (the rest the store held, leased)
    lent_at: float = 0.0  # when the blocks were lent (``time.monotonic``, at publish)


@dataclass(frozen=True)
class Durability:
    """What became of a captured publication's root."""

    seq_id: str | int
    durable: bool
    reason: str  # "durable", or why not (a DurableStatus name, or "no_answer")


@dataclass(frozen=True)
class LoadResult:
    """A load the restore worker is done with: it writes nothing more into its blocks, so
    the engine may use (or reuse) them. ``tokens``: the tokens loaded, a prefix (pages
    0..n-1 verified and written). ``status``: ``ok`` (all asked for), ``partial`` (the
    store held less), ``corrupt`` (page ``bad_page`` failed verification; it was never
    written, and maintenance is asked to quarantine it), ``worker_gone`` (the worker died
    with it: nothing is known about the blocks past ``tokens``), why the worker refused
    it (``unregistered``, ``bad_block``, ``failed``, ``malformed``, ``stale``), or why the
    client could not hand it (or its next part) over once it had waited in the queue
    (``supervisor_absent``, ``restore_down``). A load larger than ``PART_PAGES`` pages
    ends with its last part's status; ``tokens`` counts every part."""

    load_id: Hashable
    tokens: int
    status: str
    bad_page: int | None = None


@dataclass
class _Load:
    load_id: Hashable
    keys: np.ndarray  # (pages, 2): the page keys' u64 halves, as the ring carries them
    blocks: np.ndarray  # one per page
    ntokens: int
    waiting_since: float  # monotonic: when it (its next part) joined the queue
    done: int = 0  # leading pages of the parts answered ``ok``
    part: int = 0  # pages of the part with the restore worker
    worker: tuple[int, float] | None = None  # the restore worker asked: pid, start time
    queued: bool = False  # waiting for room, counted in ``loads_queued``
    lease: int = 0  # the read lease its lookup took, released when it ends; 0: none


@dataclass
class _Pending:
    seq_id: str | int
    blocks: list[int]
    deadline: float
    lent_at: float


@dataclass
class _Registration:
    views: kvmem.BlockViews
    reg_gen: int
    namespace: Namespace
    seed: bytes


class _Connection:
    """The client's ends of the rank's segments."""

    def __init__(self, cfg: Config, rank: int) -> None:
        self.parts: list = []
        # A worker silent this long is down (the supervisor kills it at the same age):
        # publications are skipped meanwhile.
        self.stale_after_s = cfg.heartbeat_timeout_s
        rt = runtime.read(cfg.store_dir) or {}
        runtime.check_namespace(rt)
        self.supervisor = runtime.supervisor_identity(rt)
        try:
            self.stats = self._keep(segments.attach_stats(cfg, rank))
            self.arena = self._keep(segments.attach_arena(cfg, rank))
            self.publish = self._keep(segments.producer(cfg, rank, "publish"))
            # spin_s=0: an empty poll must return at once, not spin in the engine.
            self.completion = self._keep(segments.consumer(cfg, rank, "completion", spin_s=0))
            self.durable = self._keep(segments.consumer(cfg, rank, "durable", spin_s=0))
            self.request = self._keep(segments.producer(cfg, rank, "request"))
            # The running supervisor's cap, not this process's idea of it.
            self.hard_cap = int(rt.get("hard_cap_bytes", cfg.hard_cap_bytes))
            self.load = self._keep(segments.producer(cfg, rank, "load"))
            self.loaded = self._keep(segments.consumer(cfg, rank, "loaded", spin_s=0))
            # Optional: without it (a supervisor of an older version) the counters are
            # only not published.
            self.engine = EngineStatsWriter.attach(cfg, rank, SLOT_CLIENT)
            if self.engine is not None:
                self._keep(self.engine)
        except BaseException:
            self.close()
            raise

    def _keep(self, part: Any) -> Any:  # any end with close() or detach()
        self.parts.append(part)
        return part

    def worker_alive(self, role: Role) -> bool:
        return worker_alive(self.stats.read(int(role)), self.stale_after_s)

    def restore_worker(self) -> tuple[int, float] | None:
        """The live restore worker's pid and start time, or None if it is not up."""
        report = self.stats.read(int(Role.RESTORE))
        if not worker_alive(report, self.stale_after_s):
            return None
        return int(report.pid), float(report.pid_start)

    def store_used(self) -> int:
        report = self.stats.read(int(Role.MAINTENANCE))
        return 0 if report is None else int(report.used_bytes)

    def close(self) -> None:
        for part in reversed(self.parts):
            try:
                part.detach() if isinstance(part, Producer) else part.close()
            except Exception:  # a half-attached end; nothing else to release
                log.debug("closing %r failed", part, exc_info=True)
        self.parts = []


class SparkCacheClient:
    """One per engine rank. See the module doc for what it promises."""

    def __init__(
        self,
        cfg: Config,
        rank: int = 0,
        *,
        model_id: str,
        tp_size: int = 1,
    ) -> None:
        """``model_id`` names the model's weights (e.g. name and revision): part of every
        page key, so it must be given, and be the same after a restart."""
        if not isinstance(model_id, str) or not model_id.strip():
            raise ValueError(
                f"model_id {model_id!r}: give the model's identity (e.g. its name and "
                f"revision); pages are keyed by it"
            )
        self.cfg = cfg
        self.rank = rank
        self.model_id = model_id
        self.tp_size = tp_size
        # Sequences with publications pending, at most; a sequence counts once however
        # many of its publications are (a save of a request still running, then its final
        # one), and partial ones are admitted only while half of it is free, so saves of
        # running requests never take the room finished requests' saves need.
        self.max_pending = 2 * cfg.capture_slots
        self.counters = ClientCounters()
        self._reg: _Registration | None = None
        self._conn: _Connection | None = None
        self._next_connect = 0.0
        # Why there is no connection, as refusals meanwhile are counted (``attachment``),
        # and the last thing said of it.
        self._absent = attachment.SUPERVISOR_ABSENT
        self._said: str | None = None
        self._reader: StoreReader | None = None
        self._pending: dict[int, _Pending] = {}
        self._released: list[Completion] = []
        # Captured publications whose durability commit has yet to report: pub id ->
        # (seq id, captured at).
        self._awaiting: dict[int, tuple[str | int, float]] = {}
        # Publications whose durability report overtook their completion (two rings):
        # settled already, their completion must not await it again.
        self._durable_early: set[int] = set()
        # Publications released by their deadline, for a capture that finished the copy
        # after it: its commit's durability report is still taken (bounded: a capture
        # that never answers leaves nothing to wait for).
        self._expired: OrderedDict[int, str | int] = OrderedDict()
        self._expire_at = 0.0  # when poll_completions next looks for lost reports
        # Reports not yet taken by poll_durable; an engine that never asks keeps only the
        # newest (its counters still count every one).
        self._settled: deque[Durability] = deque(maxlen=SETTLED_KEPT)
        self._health_at = 0.0
        self._capture_alive = False
        self._store_full = False
        self._pub_ids = itertools.count(int.from_bytes(os.urandom(4), "little") << 20)
        self._scratch = np.empty(0, np.uint8)
        self._loads: dict[int, _Load] = {}  # wire id -> load (part) with the worker
        # Loads (or their next parts) waiting for room in the ring and under MAX_LOADS,
        # in the order they came. Bounded by the engine: one load per request it holds
        # blocks for (vLLM: its running requests), never refused for room.
        self._waiting: deque[_Load] = deque()
        # Publications taken (their blocks lent, in ``_pending``) that the publish ring
        # had no room for, in order: pushed as capture makes room (``_push_waiting``),
        # released like any other at their deadline. The ring holds 32,768 pages, fewer
        # than two 300k-token publications; refused, the second was never stored, and
        # neither was the conversation's next turn. Bounded by ``max_pending``.
        self._unpushed: deque[tuple[int, np.ndarray]] = deque()
        self._load_ids: set[Hashable] = set()  # the engine's ids of both
        self._load_results: list[LoadResult] = []
        self._load_wire_ids = itertools.count(int.from_bytes(os.urandom(4), "little") << 20)
        self._reap_at = 0.0
        self._restore_id_at = 0.0
        self._restore_id: tuple[int, float] | None = None
        self._log = RateLimitedLog(log)

    # ---------------------------------------------------------------- registration

    def register_kv_caches(self, tensors: Sequence[torch.Tensor], block_dim: int = 1,
                           block_size_dim: int | None = None, *,
                           kv_layout: str | None = None, kv_dtype: str | None = None) -> bool:
        """Register the layer tensors (block ``b`` of a page is ``t.select(block_dim, b)``
        of each; dimension ``block_size_dim``, by default the next one, is ``page_tokens``
        long: vLLM 0.33's ``[blocks, heads, block size, K+V head size]`` views take
        ``block_dim=0, block_size_dim=2``). False if refused (logged). The namespace takes
        the per-page layout only (``kvmem.page_layout``), not the number of blocks:
        re-registering after a restart finds the pages stored before.

        ``kv_layout`` is for tensors that stage another set's pages (an engine whose KV no
        other process can open copies its pages through shared ones): the page layout of
        the tensors whose bytes these stand for. ``kv_dtype``: the KV format where the
        tensors' dtype does not name it (vLLM keeps every fp8 / fp4 format in uint8
        tensors), in the namespace in its place. The namespace is also written to the
        registry, so a process without tensors (vLLM's scheduler) computes the same keys."""
        try:
            tensors = list(tensors)
            shape = tensors[0].shape
            size_dim = block_dim + 1 if block_size_dim is None else block_size_dim
            if shape[size_dim] != self.cfg.page_tokens:
                raise ValueError(
                    f"block size {shape[size_dim]} (dimension {size_dim} of "
                    f"{list(shape)}) != page_tokens {self.cfg.page_tokens}"
                )
            views = kvmem.BlockViews(tensors, block_dim)
            self.cfg.check_page_fits(views.page_bytes)
            reg_gen = int.from_bytes(os.urandom(4), "little") or 1
            ns = Namespace(
                self.model_id, kv_dtype or str(tensors[0].dtype),
                kv_layout or views.page_layout(),
                self.tp_size, self.rank, self.cfg.page_tokens,
            )
            kvmem.write_registry(
                self.cfg.store_dir, self.rank, reg_gen, block_dim,
                {**kvmem.describe(tensors), "namespace": dataclasses.asdict(ns),
                 # Whose tensors: restore opens a registration ahead of its first load
                 # only while its engine lives (a dead one's segment is not kept mapped).
                 "owner_pid": os.getpid(),
                 "owner_start": process_start(os.getpid())},
            )
            self._reg = _Registration(views, reg_gen, ns, ns.seed())
        except Exception:
            log.exception("register_kv_caches refused")
            self.counters.skipped["register_failed"] += 1
            return False
        # Said now, as the engine starts, not at its first request: attached to which
        # supervisor, or why not.
        self._next_connect = 0.0
        self._connection()
        return True

    # ---------------------------------------------------------------- publication

    def _connection(self) -> _Connection | None:
        if self._conn is not None:
            return self._conn
        now = time.monotonic()
        if now < self._next_connect:
            return None
        self._next_connect = now + RECONNECT_INTERVAL_S
        found: attachment.Attachment | None = None
        try:
            found = attachment.find(self.cfg, self.rank)
            if found.reason in attachment.MISMATCHES:
                self._not_attached(found.reason, found.message, logging.WARNING)
                return None
            self._conn = _Connection(self.cfg, self.rank)
        except runtime.OtherNamespace as exc:
            # A deployment error, not a supervisor starting or stopping: said as a warning.
            self._not_attached(attachment.SUPERVISOR_ABSENT, str(exc), logging.WARNING)
        except Exception as exc:
            log.debug("supervisor segments not available: %s", exc)
            why = found.message if found is not None and found.reason else \
                f"the supervisor's segments of instance {self.cfg.instance!r}: {exc}"
            self._not_attached(attachment.SUPERVISOR_ABSENT, why, logging.INFO)
        else:
            self._absent = attachment.SUPERVISOR_ABSENT
            self._announce(f"attached to {found.message}", logging.INFO)
        return self._conn

    def _not_attached(self, reason: str, message: str, level: int) -> None:
        """No connection, for ``reason``: what its refusals are counted as from now."""
        self._absent = reason
        self._announce(f"not attached: {message}", level)

    def _announce(self, what: str, level: int) -> None:
        """Say where this rank stands once each time it changes (a connection made, a
        mismatch found, the supervisor gone), with the engine's page size and mode."""
        if what == self._said:
            return
        self._said = what
        page = ""
        if self._reg is not None:
            page = (f"; pages of {self.cfg.page_tokens} tokens, "
                    f"{self._reg.views.page_bytes} bytes")
        log.log(level, "SparkCache rank %d %s%s; mode %s", self.rank, what, page,
                self.cfg.access_mode.value)

    def _publish_counters(self, force: bool = False) -> None:
        """Copy the counters into the rank's engine stats block for the supervisor's
        /metrics, at most once per ``engine_stats.WRITE_INTERVAL_S`` (a clock read
        otherwise). Called from the polls and lookups the engine makes anyway."""
        conn = self._conn
        if conn is not None and conn.engine is not None:
            conn.engine.write_due(self.counters.fields, force)

    def _attach_again(self) -> _Connection | None:
        """A worker of this connection was found stopped. If ``runtime.json`` names
        another supervisor than the one attached (an upgrade, a restart), drop the
        connection and attach to the new one's segments at once (still at most once per
        ``RECONNECT_INTERVAL_S``), so the call that found it is served by the successor
        rather than refused. If it names the same one, the worker is down under it,
        which restarts it in place: the connection stays (re-attaching would open every
        segment again on the engine's thread, and find the same ones)."""
        conn = self._conn
        if conn is not None and runtime.names_supervisor(self.cfg.store_dir, conn.supervisor):
            return conn
        self._disconnect()
        return self._connection()

    def _disconnect(self) -> None:
        if self._conn is not None:
            # What was counted since the last write reaches this supervisor's block.
            self._publish_counters(force=True)
            self._conn.close()
            self._conn = None
        self._restore_id_at = 0.0

    def _restore_worker(self, conn: _Connection) -> tuple[int, float] | None:
        """``conn.restore_worker()``, read at most once per ``RESTORE_CACHE_S``."""
        now = time.monotonic()
        if now >= self._restore_id_at:
            self._restore_id = conn.restore_worker()
            self._restore_id_at = now + RESTORE_CACHE_S
        return self._restore_id

    def _read_health(self, conn: _Connection, now: float) -> None:
        """Whether capture is alive and the store below its hard cap, from ``conn``'s
        stats, read at most every ``HEALTH_CACHE_S``: reading them per call costs more
        than the rest of a publication."""
        self._health_at = now + HEALTH_CACHE_S
        self._capture_alive = conn.worker_alive(Role.CAPTURE)
        self._store_full = conn.store_used() >= conn.hard_cap

    def _pending_seqs(self) -> set[str | int]:
        return {entry.seq_id for entry in self._pending.values()}

    def _admission(self, seq_id: str | int, partial: bool) -> str | None:
        """Why a publication of ``seq_id`` cannot be taken now, or None."""
        if self.cfg.access_mode is AccessMode.OFF:
            return "mode_off"
        if self.cfg.access_mode is AccessMode.RESTORE_ONLY:
            return "restore_only"
        if self._reg is None:
            return "unregistered"
        conn = self._connection()
        if conn is None:
            return self._absent
        if self._reg.views.page_bytes > conn.arena.slot_bytes:
            self._announce(
                f"cannot save: a page of this engine ({self._reg.views.page_bytes} bytes) "
                f"is larger than the supervisor's capture slots ({conn.arena.slot_bytes} "
                f"bytes): start the supervisor with SPARKCACHE_CAPTURE_SLOT_BYTES of at "
                f"least a page; loads are served", logging.WARNING)
            return "page_too_large"
        limit = self.max_pending // 2 if partial else self.max_pending
        if len(self._pending) >= limit and seq_id not in self._pending_seqs():
            self._poll(conn)  # only then: the engine polls every step anyway
            seqs = self._pending_seqs()
            if len(seqs) >= limit and seq_id not in seqs:
                return "pending_limit"
        now = time.monotonic()
        if now >= self._health_at:
            self._read_health(conn, now)
            if not self._capture_alive:
                # The successor's capture takes the publication instead of it being
                # skipped (``_attach_again``).
                conn = self._attach_again()
                if conn is None:
                    return "supervisor_absent"
                self._read_health(conn, now)
        if not self._capture_alive:
            return "capture_down"  # asked again after HEALTH_CACHE_S
        if self._store_full:
            return "store_full"
        if not (conn.arena.state["owner"] == FREE).any():
            return "no_slot"
        return None

    def publish(self, seq_id: str | int, token_ids: Sequence[int] | np.ndarray,
                block_ids: Sequence[int], *, extra: KeyExtras | None = None) -> bool:
        """Queue the pages of ``token_ids`` (held in ``block_ids``) for capture, keyed with
        the request's ``extra`` (adapter, multimodal hashes, cache salt). True if taken:
        its blocks then stay in use until ``poll_completions`` releases them."""
        try:
            reason = self._admission(seq_id, False)
            if reason is None:
                reason = self._push(seq_id, split_keys(self._keys(token_ids, extra)),
                                    block_ids)
        except Exception:
            self._ring_fault("publish")
            reason = "error"
        if reason is not None:
            self.counters.skipped[reason] += 1
            return False
        return True

    def publish_keys(self, seq_id: str | int, keys: Sequence[str] | bytes,
                     block_ids: Sequence[int], *, partial: bool = False) -> bool:
        """``publish`` for a caller that computed the page keys itself (vLLM's scheduler
        does, incrementally), as hex strings or as their raw bytes (``keys_bytes``): page
        ``i`` of ``keys`` is held in ``block_ids[i]``. ``partial``: the pages so far of a
        sequence still growing, which a later publication of it supersedes; admitted only
        while half the pending limit is free (``max_pending``)."""
        try:
            reason = self._admission(seq_id, partial)
            if reason is None:
                reason = self._push(seq_id, key_halves(keys), block_ids)
        except ValueError:
            reason = "bad_request"
        except Exception:
            self._ring_fault("publish")
            reason = "error"
        if reason is not None:
            self.counters.skipped[reason] += 1
            return False
        return True

    def _push(self, seq_id: str | int, halves: np.ndarray,
              block_ids: Sequence[int]) -> str | None:
        """Publish the pages whose keys' halves are ``halves`` (from ``key_halves``)."""
        reg, conn = self._reg, self._conn
        assert reg is not None and conn is not None
        n = len(halves)
        if n == 0 or len(block_ids) < n:
            return "bad_request"
        if n > segments.RINGS["publish"][1]:
            return "too_large"
        root = hashlib.blake2b(reg.seed + str(seq_id).encode(), digest_size=16).digest()
        pub_id = next(self._pub_ids)
        # A publication larger than the arena goes to commit a slot at a time, and after
        # those lent before it: its blocks are lent for longer, in proportion (capture
        # checks the bound).
        now = time.monotonic()
        ahead = min(sum(len(p.blocks) for p in self._pending.values()),
                    segments.PUBLISH_AHEAD_MAX_PAGES)
        deadline = now + release_seconds(
            self.cfg.release_timeout_seconds, n * reg.views.page_bytes,
            conn.arena.slots * conn.arena.slot_bytes, ahead * reg.views.page_bytes)
        recs = _PUBLISH_SHARED.batch(n, pub_id, int.from_bytes(root[:8], "little"),
                                     int.from_bytes(root[8:], "little"), deadline,
                                     reg.reg_gen, n)
        recs["key_hi"], recs["key_lo"] = halves[:, 0], halves[:, 1]
        recs["block_id"] = block_ids[:n]
        recs["page_index"] = _PAGE_INDEX[:n]
        queued = bool(self._unpushed)  # in order: none overtakes one waiting
        if not queued:
            try:
                conn.publish.push_batch(recs)
            except RingFull:
                queued = True
        if queued:
            self._unpushed.append((pub_id, recs))
            self.counters.publications_queued += 1
        self._pending[pub_id] = _Pending(seq_id, list(block_ids[:n]), deadline, now)
        self.counters.published += 1
        self.counters.pages_published += n
        return None

    def _ring_fault(self, what: str) -> None:
        """A ring raised something other than full/empty (closed, gone, corrupt): count
        it, drop the connection (a new supervisor may have new segments) and go on."""
        self.counters.ring_errors += 1
        log.warning("%s: ring error; reconnecting later", what, exc_info=True)
        self._disconnect()

    def _push_waiting(self, conn: _Connection, now: float) -> None:
        """Push the publications waiting for room in the ring, in order, while it has
        room; one whose deadline is past (released, or about to be) is dropped, never
        pushed: its blocks may be the engine's again."""
        while self._unpushed:
            pub_id, recs = self._unpushed[0]
            entry = self._pending.get(pub_id)
            if entry is not None and entry.deadline > now:
                try:
                    conn.publish.push_batch(recs)
                except RingFull:
                    return
            self._unpushed.popleft()

    def _poll(self, conn: _Connection) -> None:
        """Move completions to ``_released`` and durability reports to ``_settled``, and
        push the publications waiting for room."""
        now = time.monotonic()
        self._push_waiting(conn, now)
        for pub_id, status, copied in self._drain(conn.completion):
            entry = self._pending.pop(pub_id, None)
            if entry is None:
                late = self._expired.pop(pub_id, None)
                if late is not None and status == CaptureStatus.CAPTURED:
                    # Copied after its deadline released the blocks (capture checked it
                    # just before): committed all the same, so its report is awaited.
                    self._awaiting[pub_id] = (late, now)
                continue  # else released by its deadline already, or not ours
            what = status_name(CaptureStatus, status)
            self._released.append(Completion(entry.seq_id, entry.blocks, what, copied,
                                             entry.lent_at))
            early = pub_id in self._durable_early
            self._durable_early.discard(pub_id)
            if status == CaptureStatus.CAPTURED:
                self.counters.completed += 1
                if not early:
                    self._awaiting[pub_id] = (entry.seq_id, now)
            else:
                self.counters.capture_failed[what] += 1
        for pub_id, status, _ in self._drain(conn.durable):
            # The durable report can overtake the completion (two rings): look in both,
            # and among those released by their deadline.
            entry = self._awaiting.pop(pub_id, None)
            if entry is None:
                pending = self._pending.get(pub_id)
                if pending is not None and pub_id in self._durable_early:
                    continue  # a restarted commit's redo, reported again
                if pending is not None:
                    entry = (pending.seq_id, now)
                    self._durable_early.add(pub_id)
                elif pub_id in self._expired:
                    entry = (self._expired.pop(pub_id), now)
                else:
                    continue
            self._settle(entry[0], status_name(DurableStatus, status))

    @staticmethod
    def _drain(consumer: Any) -> list[tuple]:
        out: list[tuple] = []
        while True:
            try:
                out += consumer.pop_batch(256, timeout=0).tolist()
            except RingEmpty:
                return out

    def _settle(self, seq_id: str | int, reason: str) -> None:
        durable = reason == "durable"
        self._settled.append(Durability(seq_id, durable, reason))
        if durable:
            self.counters.durable += 1
        else:
            self.counters.not_durable[reason] += 1

    def _poll_safely(self) -> None:
        try:
            conn = self._connection()
            if conn is not None:
                self._poll(conn)
        except Exception:
            self._ring_fault("completion poll")
        self._publish_counters()

    def poll_completions(self) -> list[Completion]:
        """Publications whose blocks the engine may reuse now: captured (copied; see
        ``poll_durable`` for whether the root reached the store), refused, or past their
        deadline ("expired")."""
        self._poll_safely()
        now = time.monotonic()
        for pub_id in [p for p, e in self._pending.items() if e.deadline <= now]:
            entry = self._pending.pop(pub_id)
            self._released.append(Completion(entry.seq_id, entry.blocks, "expired",
                                             lent_at=entry.lent_at))
            self.counters.released_by_deadline += 1
            if pub_id in self._durable_early:
                self._durable_early.discard(pub_id)  # settled already
                continue
            self._expired[pub_id] = entry.seq_id
            if len(self._expired) > EXPIRED_KEPT:
                self._expired.popitem(last=False)
        if now >= self._expire_at:
            # A caller that never asks for durability (vLLM's connector) must not keep
            # the reports that never came either.
            self._expire_at = now + 1.0
            self._expire_awaiting(now)
        released, self._released = self._released, []
        return released

    def busy_ids(self) -> set[Hashable]:
        """The engine's ids of the publications and loads whose blocks a worker may still
        use: lent to capture (until copied, refused or past their deadline), with the
        restore worker, or waiting for it. For a caller whose own bookkeeping failed: a
        job whose id is not here is over, its blocks the engine's. Polls first (both
        polls' results are the caller's to have dropped); never raises."""
        self.poll_completions()
        self.poll_loads()
        return ({e.seq_id for e in self._pending.values()}
                | {e.load_id for e in self._loads.values()}
                | {e.load_id for e in self._waiting})

    def poll_durable(self) -> list[Durability]:
        """Captured publications whose fate is now known: durable, or failed and why."""
        self._poll_safely()
        self._expire_awaiting(time.monotonic())
        settled = list(self._settled)
        self._settled.clear()
        return settled

    def _expire_awaiting(self, now: float) -> None:
        """Captured publications whose durability report has not come within
        DURABLE_TIMEOUT_S (commit died with it, or its ring was full) settle as
        ``no_answer``."""
        # Entries are in the order they were captured: the overdue ones come first.
        while self._awaiting:
            pub_id, (seq_id, since) = next(iter(self._awaiting.items()))
            if now - since <= DURABLE_TIMEOUT_S:
                break
            del self._awaiting[pub_id]
            self._settle(seq_id, "no_answer")

    @property
    def pending(self) -> int:
        """Publications whose blocks are still held."""
        return len(self._pending)

    @property
    def awaiting_durable(self) -> int:
        """Captured publications whose durability is not known yet."""
        return len(self._awaiting)

    # ---------------------------------------------------------------- read side

    def _open_reader(self) -> StoreReader:
        if self._reader is None:
            self._reader = StoreReader(self.cfg.store_dir, self.rank)
        return self._reader

    def _keys(self, token_ids: Sequence[int] | np.ndarray,
              extra: KeyExtras | None = None) -> list[str]:
        assert self._reg is not None
        if extra is not None and not isinstance(extra, KeyExtras):
            raise TypeError(f"extra must be a KeyExtras or None, not {type(extra).__name__}")
        return list(sequence_keys(self._reg.namespace, token_ids, extra).all())

    def _request(self, kind: RequestKind, key: str, arg: int, seconds: float = 0.0,
                 lease: int = 0) -> bool:
        """Send maintenance a request; False if it could not be sent."""
        conn = self._connection()
        if conn is None:
            self.counters.requests_dropped += 1
            return False
        try:
            conn.request.try_push((int(kind), 0, *split_key(key), arg, lease, time.time(),
                                   seconds))
            return True
        except RingFull:
            self.counters.requests_dropped += 1
        except Exception:
            self._ring_fault("request")
        return False

    def lookup(self, token_ids: Sequence[int] | np.ndarray, *,
               extra: KeyExtras | None = None, lease: int = 0) -> int:
        """Tokens of ``token_ids`` (with the request's ``extra``) whose pages the store
        holds (a prefix), leased as read lease ``lease`` (``protocol.new_lease_id``; 0: an
        anonymous one) until the load given that lease ends (``load``) or ``release``,
        or ``lookup_lease_seconds`` at most, so the load that follows finds them; 0 on
        any fault, or when the lease cannot be taken at once (a miss, counted)."""
        try:
            if self.cfg.access_mode is AccessMode.OFF or self._reg is None:
                return 0
            self.counters.lookups += 1
            self.counters.lookup_tokens += len(token_ids)
            tokens = self._lookup(token_ids, extra, lease)
            self.counters.hit_tokens += tokens
            return tokens
        except Exception:
            log.warning("lookup failed; a miss", exc_info=True)
            self._lookup_miss("error")
            return 0
        finally:
            self._publish_counters()

    def _lookup_miss(self, reason: str) -> None:
        self.counters.misses[reason] += 1
        self.counters.lookup_misses[reason] += 1

    def _lookup(self, token_ids: Sequence[int] | np.ndarray, extra: KeyExtras | None,
                lease: int) -> int:
        keys = self._keys(token_ids, extra)
        reader = self._open_reader()
        if not reader.gate.try_shared():
            self._lookup_miss("evicting")
            return 0
        try:
            pages = reader.lookup(keys)
            if pages and self._connection() is None:
                # No supervisor, so no maintenance evicts: what was counted stays
                # until one starts. Restoring from disk then still works.
                self.counters.unleased_lookups += 1
            elif pages and not self._request(RequestKind.LEASE, keys[pages - 1],
                                             pages - 1, self.cfg.lookup_lease_seconds, lease):
                self._lookup_miss("no_lease")
                return 0
        finally:
            reader.gate.release()
        return min(pages * self.cfg.page_tokens, len(token_ids))

    def restore(self, token_ids: Sequence[int] | np.ndarray, block_ids: Sequence[int], *,
                extra: KeyExtras | None = None) -> int:
        """Read the stored prefix of ``token_ids`` (with the request's ``extra``) into
        ``block_ids`` of the registered tensors; the number of tokens restored (0 on any
        fault)."""
        try:
            return self._restore(token_ids, block_ids, extra)
        except Exception:
            log.warning("restore failed; a miss", exc_info=True)
            self.counters.misses["error"] += 1
            return 0

    def _restore(self, token_ids: Sequence[int] | np.ndarray, block_ids: Sequence[int],
                 extra: KeyExtras | None = None) -> int:
        if self.cfg.access_mode is AccessMode.OFF or self._reg is None:
            return 0
        got = self._restore_keys(self._keys(token_ids, extra)[: len(block_ids)], block_ids)
        return min(got * self.cfg.page_tokens, len(token_ids))

    def restore_keys(self, keys: Sequence[str], block_ids: Sequence[int]) -> int:
        """``restore`` by page keys: the number of leading pages restored into
        ``block_ids`` (0 on any fault)."""
        try:
            if self.cfg.access_mode is AccessMode.OFF or self._reg is None:
                return 0
            return self._restore_keys(list(keys)[: len(block_ids)], block_ids)
        except Exception:
            log.warning("restore failed; a miss", exc_info=True)
            self.counters.misses["error"] += 1
            return 0

    def _restore_keys(self, keys: Sequence[str], block_ids: Sequence[int]) -> int:
        reg = self._reg
        assert reg is not None
        if any(not 0 <= b < reg.views.num_blocks for b in block_ids[: len(keys)]):
            self.counters.misses["bad_block"] += 1
            return 0
        if not keys:
            return 0
        reader = self._open_reader()
        pbytes = reg.views.page_bytes
        if self._scratch.size < len(keys) * pbytes:
            self._scratch = np.empty(len(keys) * pbytes, np.uint8)
        rows = self._scratch[: len(keys) * pbytes].reshape(len(keys), pbytes)
        result = reader.restore(keys, list(rows))
        got = result.pages
        for i in range(got):
            reg.views.scatter(int(block_ids[i]), rows[i])
        self.counters.restored_pages += got
        for bad in result.bad:
            self.counters.misses["corrupt"] += 1
            self._request(RequestKind.QUARANTINE, bad.key, int(bad.generation, 16))
        if got < len(keys):
            self.counters.misses["not_stored"] += 1
        if got:
            # Only an access time is lost if this cannot be sent; the lease then ends early.
            self._request(RequestKind.TOUCH, keys[got - 1], got - 1)
        return got

    # ---------------------------------------------------------------- asynchronous loads

    def release(self, lease: int) -> None:
        """End read lease ``lease`` whose load will not come (the request went): its
        pages need not wait ``lookup_lease_seconds``. Never raises; a release that cannot
        be sent is counted in ``requests_dropped`` and the lease ends at its bound."""
        if lease:
            try:
                self._request(RequestKind.RELEASE, _NO_KEY, 0, lease=lease)
            except Exception:
                log.warning("releasing a read lease failed", exc_info=True)

    def load(self, load_id: Hashable, token_ids: Sequence[int] | np.ndarray,
             block_ids: Sequence[int], *, extra: KeyExtras | None = None,
             max_pages: int | None = None, lease: int = 0) -> bool:
        """Queue a load of the stored prefix of ``token_ids`` (with the request's
        ``extra``; at most ``max_pages`` pages, one per block of ``block_ids``) into those
        blocks. True if taken: the blocks are then SparkCache's until ``poll_loads``
        reports ``load_id``. A load the ring or ``MAX_LOADS`` has no room for now waits in
        the client's queue, and ``poll_loads`` hands it over as room frees: room is never
        a reason to refuse. False if refused (counted in ``counters.misses`` by reason);
        never raises, never waits. ``lease``: the read lease the lookup took, released
        once the load ends (or is refused)."""
        try:
            keys = []
            if self._reg is not None and self.cfg.access_mode is not AccessMode.OFF:
                keys = self._keys(token_ids, extra)[: len(block_ids)]
                if max_pages is not None:
                    keys = keys[: max(0, max_pages)]
            reason = self._queue_load(load_id, split_keys(keys), len(token_ids), block_ids,
                                      lease)
        except Exception:
            self._ring_fault("load")
            reason = "error"
        return self._taken(reason, lease)

    def _taken(self, reason: str | None, lease: int) -> bool:
        """Whether a load was taken; a refused one is counted, and its lease released."""
        if reason is None:
            return True
        self.counters.misses[reason] += 1
        self.release(lease)
        return False

    def load_keys(self, load_id: Hashable, keys: Sequence[str] | bytes,
                  block_ids: Sequence[int], *, lease: int = 0) -> bool:
        """``load`` for a caller that computed the page keys itself (vLLM's scheduler
        does), as hex strings or as their raw bytes (``keys_bytes``): page ``i`` of
        ``keys`` goes into ``block_ids[i]``."""
        try:
            halves = key_halves(keys)[: len(block_ids)]
            reason = self._queue_load(load_id, halves, len(halves) * self.cfg.page_tokens,
                                      block_ids, lease)
        except ValueError:
            reason = "bad_request"
        except Exception:
            self._ring_fault("load")
            reason = "error"
        return self._taken(reason, lease)

    def _queue_load(self, load_id: Hashable, halves: np.ndarray, ntokens: int,
                    block_ids: Sequence[int], lease: int) -> str | None:
        """Take a load of the pages whose keys' halves are ``halves`` (``key_halves``)
        into the queue and hand over what there is room for."""
        reg = self._reg
        if self.cfg.access_mode is AccessMode.OFF:
            return "mode_off"
        if reg is None:
            return "unregistered"
        if load_id in self._load_ids:
            return "duplicate_load"
        n = len(halves)
        if n == 0:
            return "empty_load"
        blocks = np.asarray(block_ids[:n], dtype=np.int64)
        if (blocks < 0).any() or (blocks >= reg.views.num_blocks).any():
            return "bad_block"
        target = self._restore_target()
        if isinstance(target, str):
            return target
        self._waiting.append(_Load(load_id, halves, blocks, ntokens, time.monotonic(),
                                   lease=lease))
        self._load_ids.add(load_id)
        self.counters.loads += 1
        try:
            self._send_waiting(*target)
        except Exception:
            # Taken all the same: the next poll_loads hands it over, or ends it.
            self._ring_fault("load")
        return None

    def _restore_target(self) -> tuple[_Connection, tuple[int, float]] | str:
        """The connection and the live restore worker to hand loads to, or why there are
        none (``supervisor_absent``, ``restore_down``)."""
        conn = self._connection()
        if conn is None:
            return self._absent
        worker = self._restore_worker(conn)
        if worker is None:
            # The successor's restore worker takes the load (``_attach_again``). Loads
            # in flight keep theirs; only its death reports them.
            conn = self._attach_again()
            worker = self._restore_worker(conn) if conn is not None else None
            if conn is None or worker is None:
                return "restore_down"  # asked again after RESTORE_CACHE_S
        return conn, worker

    def _send_waiting(self, conn: _Connection, worker: tuple[int, float]) -> None:
        """Hand the waiting loads to ``worker``, in order, while the ring and MAX_LOADS
        have room; the rest wait for the next poll, each counted once with its wait."""
        reg = self._reg
        assert reg is not None
        now = time.monotonic()
        while self._waiting and len(self._loads) < MAX_LOADS:
            entry = self._waiting[0]
            n = min(PART_PAGES, len(entry.keys) - entry.done)
            part = slice(entry.done, entry.done + n)
            wire_id = next(self._load_wire_ids)
            recs = _LOAD_SHARED.batch(n, wire_id, worker[1], worker[0], reg.reg_gen, n)
            recs["key_hi"], recs["key_lo"] = entry.keys[part, 0], entry.keys[part, 1]
            recs["block_id"] = entry.blocks[part]
            recs["page_index"] = _PAGE_INDEX[:n]
            try:
                conn.load.push_batch(recs)
            except RingFull:
                break
            self._waiting.popleft()
            entry.part, entry.worker = n, worker
            self._loads[wire_id] = entry
            if entry.queued:
                entry.queued = False
                self.counters.load_queue_seconds += now - entry.waiting_since
        for entry in self._waiting:
            if not entry.queued:
                entry.queued = True
                self.counters.loads_queued += 1
        self.counters.load_queue_depth = len(self._waiting)

    def _send_or_end_waiting(self) -> None:
        """Hand waiting loads over as room frees; with no restore worker to take them,
        they end as a load would be refused (``restore_down``, ``supervisor_absent``),
        with the pages of their parts already loaded."""
        if not self._waiting:
            return
        target = self._restore_target()
        if not isinstance(target, str):
            self._send_waiting(*target)
            return
        while self._waiting:
            entry = self._waiting.popleft()
            self.counters.misses[target] += 1
            self._end_load(entry, entry.done, target)
        self.counters.load_queue_depth = 0

    def poll_loads(self) -> list[LoadResult]:
        """Loads whose blocks the restore worker is done with (see ``LoadResult``): it
        answered, or the process asked is gone. Hands waiting loads over as room frees.
        Never raises."""
        try:
            conn = self._connection()
            if conn is not None:
                self._take_loaded(conn)
        except Exception:
            self._ring_fault("loaded poll")
        try:
            self._reap_loads()
        except Exception:
            log.warning("checking the restore worker failed", exc_info=True)
        try:
            self._send_or_end_waiting()
        except Exception:
            self._ring_fault("load")
        self._publish_counters()
        done, self._load_results = self._load_results, []
        return done

    def _take_loaded(self, conn: _Connection) -> None:
        for wire_id, status, pages, bad_index, _, hi, lo, gen in self._drain(conn.loaded):
            entry = self._loads.get(wire_id)
            if entry is None:
                continue  # reported already (its worker died), or not this client's
            if status == LoadStatus.STALE:
                # Another process answered for the one asked, which must be gone; but only
                # its death, checked by the reaper, releases the blocks.
                continue
            del self._loads[wire_id]
            pages = min(pages, entry.part)
            self.counters.loaded_pages += pages
            if status == LoadStatus.OK and entry.done + pages < len(entry.keys):
                # Its next part goes first: it held its place in the queue.
                entry.done += pages
                entry.waiting_since = time.monotonic()
                self._waiting.appendleft(entry)
                continue
            bad = None
            if status == LoadStatus.CORRUPT:
                bad = entry.done + bad_index
                self.counters.misses["corrupt"] += 1
                self._request(RequestKind.QUARANTINE, join_key(hi, lo), gen)
            elif status == LoadStatus.PARTIAL:
                self.counters.misses["not_stored"] += 1
            self._end_load(entry, entry.done + pages, status_name(LoadStatus, status), bad)

    def _reap_loads(self) -> None:
        """Report the loads whose restore worker is gone (after reading its answers):
        a dead process writes nothing more. Only death counts, never silence: a stalled
        worker may still write, and the supervisor kills one whose heartbeat stops."""
        now = time.monotonic()
        if not self._loads or now < self._reap_at:
            return
        self._reap_at = now + LOAD_REAP_S
        # The live restore worker's fresh report answers for it; psutil reads /proc
        # (~0.3 ms) only for the others.
        live = self._restore_worker(self._conn) if self._conn is not None else None
        workers = {entry.worker for entry in self._loads.values()} - {live}
        gone = {w for w in workers if w is not None and process_gone(*w)}
        for wire_id, entry in list(self._loads.items()):
            if entry.worker in gone:
                del self._loads[wire_id]
                self.counters.misses["worker_gone"] += 1
                # The parts answered before stay loaded; nothing is known of this one.
                self._end_load(entry, entry.done, "worker_gone")

    def _end_load(self, entry: _Load, pages: int, status: str,
                  bad_page: int | None = None) -> None:
        """Report ``entry`` with its ``pages`` leading pages loaded, touch them, and end its
        read lease: the restore worker reads nothing more of them."""
        if pages:
            # Only an access time is lost if this cannot be sent.
            self._request(RequestKind.TOUCH, join_key(*entry.keys[pages - 1]), pages - 1)
        self.release(entry.lease)
        self._load_ids.discard(entry.load_id)
        self.counters.load_status[status] += 1
        tokens = min(pages * self.cfg.page_tokens, entry.ntokens)
        self._load_results.append(LoadResult(entry.load_id, tokens, status, bad_page))

    @property
    def loads_in_flight(self) -> int:
        """Loads not yet reported: their blocks are SparkCache's (the restore worker may
        write them, or they wait in the queue)."""
        return len(self._load_ids)

    @property
    def loads_waiting(self) -> int:
        """Loads (or their next parts) waiting in the client's queue for room."""
        return len(self._waiting)

    def close(self) -> None:
        """Detach from the rings (without closing them: a new client may attach)."""
        try:
            self._disconnect()
            if self._reader is not None:
                self._reader.close()
                self._reader = None
        except Exception:
            log.exception("client close failed")
