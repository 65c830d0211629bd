"""``SparkCacheClient``: the engine-side half of SparkCache, inside the vLLM worker.

It never blocks and never raises into the serving path: every public method catches
store and shared-memory faults and turns them into a miss or a skipped publication,
counted by reason in ``counters``. Publications go to the capture worker as page
descriptors (block id + page key; never byte ranges); the engine learns which blocks it
may reuse from ``poll_completions``. A publication not completed by its deadline is
released there and then: capture checks the same deadline (``time.monotonic`` is one
clock for every process of the host) after copying and drops a copy that finished late,
so a block the engine reuses is never stored under an old key.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shm import FREE, Producer, RingEmpty, RingFull
from shm.layouts import PUBLISH, split_key
from sparkcache import kvmem, segments
from sparkcache.config import AccessMode, Config
from sparkcache.identity import KeyExtras, Namespace, sequence_keys
from sparkcache.store import PageStore
from workers.lifecycle import Role, State

log = logging.getLogger(__name__)

STATUS_OK = 0
# A worker whose heartbeat is older than this counts as down: publications are skipped.
HEARTBEAT_STALE_S = 3.0
RECONNECT_INTERVAL_S = 1.0
HEALTH_CACHE_S = 0.05


@dataclass
class ClientCounters:
    """Process-local counters; ``skipped`` and ``errors`` are keyed by reason."""

    published: int = 0
    pages_published: int = 0
    completed: int = 0
    capture_failed: Counter = field(default_factory=Counter)
    released_by_deadline: int = 0
    skipped: Counter = field(default_factory=Counter)
    lookups: int = 0
    restored_pages: int = 0
    misses: Counter = field(default_factory=Counter)
    touches_dropped: int = 0


# Capture's completion statuses (workers.capture), by name.
CAPTURE_STATUS = {
    0: "captured", 1: "expired", 2: "unregistered", 3: "bad_block", 4: "no_slot",
    5: "too_large", 6: "failed",
}


@dataclass(frozen=True)
class Completion:
    """A publication the engine is done with: its blocks may be reused."""

    seq_id: str | int
    blocks: list[int]
    status: str  # "captured" (acknowledged), "expired", or why capture refused it


@dataclass
class _Pending:
    seq_id: str | int
    blocks: list[int]
    deadline: float


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
        try:
            self.stats = self._keep(segments.attach_stats(cfg, rank))
            self.arena = self._keep(segments.attach_arena(cfg, rank))
            self.publish = self._keep(segments.producer(cfg, rank, "publish"))
            # spin_s=0: an empty poll must return at once, not spin in the engine.
            self.completion = self._keep(segments.consumer(cfg, rank, "completion", spin_s=0))
            self.touch = self._keep(segments.producer(cfg, rank, "touch"))
        except BaseException:
            self.close()
            raise

    def _keep(self, part: Any) -> Any:  # any end with close() or detach()
        self.parts.append(part)
        return part

    def worker_alive(self, role: Role) -> bool:
        rec = self.stats.read(int(role))
        if rec is None:
            return False
        state, heartbeat = rec[1], rec[2]
        return state == State.READY and time.time() - heartbeat < HEARTBEAT_STALE_S

    def store_used(self) -> int:
        rec = self.stats.read(int(Role.MAINTENANCE))
        return 0 if rec is None else int(rec[7])

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
        release_timeout_s: float = 5.0,
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
        self.release_timeout_s = release_timeout_s
        self.max_pending = 2 * cfg.capture_slots
        # Beyond max_bytes by the gap between the watermarks: maintenance had that much
        # room to catch up; past it publications are refused rather than overrunning.
        self.hard_cap = cfg.max_bytes + (cfg.max_bytes - cfg.low_watermark_bytes)
        self.counters = ClientCounters()
        self._reg: _Registration | None = None
        self._conn: _Connection | None = None
        self._next_connect = 0.0
        self._store: PageStore | None = None
        self._pending: dict[int, _Pending] = {}
        self._released: list[Completion] = []
        self._health_at = 0.0
        self._capture_alive = False
        self._store_full = False
        self._pub_ids = itertools.count(int.from_bytes(os.urandom(4), "little") << 20)
        self._scratch = np.empty(0, np.uint8)

    # ---------------------------------------------------------------- registration

    def register_kv_caches(self, tensors: Sequence[torch.Tensor], block_dim: int = 1) -> bool:
        """Register the layer tensors (block ``b`` of a page is ``t.select(block_dim, b)``
        of each; its next dimension is ``page_tokens`` long). False if refused (logged).
        The namespace takes the per-page layout only (``kvmem.page_layout``), not the
        number of blocks: re-registering after a restart finds the pages stored before."""
        try:
            tensors = list(tensors)
            shape = tensors[0].shape
            if shape[block_dim + 1] != self.cfg.page_tokens:
                raise ValueError(
                    f"block size {shape[block_dim + 1]} != page_tokens {self.cfg.page_tokens}"
                )
            views = kvmem.BlockViews(tensors, block_dim)
            self.cfg.check_page_fits(views.page_bytes)
            reg_gen = int.from_bytes(os.urandom(4), "little") or 1
            kvmem.write_registry(
                self.cfg.store_dir, self.rank, reg_gen, block_dim, kvmem.describe(tensors)
            )
            ns = Namespace(
                self.model_id, str(tensors[0].dtype), views.page_layout(),
                self.tp_size, self.rank, self.cfg.page_tokens,
            )
            self._reg = _Registration(views, reg_gen, ns, ns.seed())
            return True
        except Exception:
            log.exception("register_kv_caches refused")
            self.counters.skipped["register_failed"] += 1
            return False

    # ---------------------------------------------------------------- publication

    def _connection(self) -> _Connection | None:
        if self._conn is not None:
            return self._conn
        now = time.monotonic()
        if now < self._next_connect:
            return None
        self._next_connect = now + RECONNECT_INTERVAL_S
        try:
            self._conn = _Connection(self.cfg, self.rank)
        except Exception as exc:
            log.debug("supervisor segments not available: %s", exc)
        return self._conn

    def _disconnect(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _admission(self) -> str | None:
        """Why a publication cannot be taken now, or None."""
        if self.cfg.access_mode is AccessMode.OFF:
            return "mode_off"
        if self.cfg.access_mode is AccessMode.RESTORE_ONLY:
            return "restore_only"
        if self._reg is None:
            return "unregistered"
        conn = self._connection()
        if conn is None:
            return "supervisor_absent"
        self._poll(conn)
        if len(self._pending) >= self.max_pending:
            return "pending_limit"
        now = time.monotonic()
        if now >= self._health_at:
            # Worker reports change at heartbeat pace: reading them per call costs more
            # than the rest of a publication.
            self._health_at = now + HEALTH_CACHE_S
            self._capture_alive = conn.worker_alive(Role.CAPTURE)
            self._store_full = conn.store_used() >= self.hard_cap
        if not self._capture_alive:
            # Maybe a new supervisor with new segments: attach afresh next time.
            self._disconnect()
            self._health_at = 0.0
            return "capture_down"
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
            reason = self._admission()
            if reason is None:
                reason = self._push(seq_id, token_ids, block_ids, extra)
        except Exception:
            log.exception("publish failed")
            reason = "error"
        if reason is not None:
            self.counters.skipped[reason] += 1
            return False
        return True

    def _push(self, seq_id: str | int, token_ids: Sequence[int] | np.ndarray,
              block_ids: Sequence[int], extra: KeyExtras | None = None) -> str | None:
        reg, conn = self._reg, self._conn
        assert reg is not None and conn is not None
        keys = self._keys(token_ids, extra)
        n = len(keys)
        if n == 0 or len(block_ids) < n:
            return "bad_request"
        if n > segments.RINGS["publish"][1]:
            return "too_large"
        recs = np.zeros(n, PUBLISH.dtype)
        halves = np.frombuffer(bytes.fromhex("".join(keys)), "<u8").reshape(n, 2)
        recs["key_hi"], recs["key_lo"] = halves[:, 0], halves[:, 1]
        root = hashlib.blake2b(reg.seed + str(seq_id).encode(), digest_size=16).hexdigest()
        pub_id = next(self._pub_ids)
        deadline = time.monotonic() + self.release_timeout_s
        recs["root_hi"], recs["root_lo"] = split_key(root)
        recs["pub_id"] = pub_id
        recs["block_id"] = np.asarray(block_ids[:n], dtype=np.int64)
        recs["deadline"] = deadline
        recs["reg_gen"] = reg.reg_gen
        recs["page_index"] = np.arange(n, dtype=np.uint32)
        recs["npages"] = n
        try:
            conn.publish.push_batch(recs)
        except RingFull:
            return "ring_full"
        self._pending[pub_id] = _Pending(seq_id, list(block_ids[:n]), deadline)
        self.counters.published += 1
        self.counters.pages_published += n
        return None

    def _poll(self, conn: _Connection) -> None:
        """Move completed publications to ``_released`` (handed out by
        ``poll_completions``)."""
        while True:
            try:
                batch = conn.completion.pop_batch(256, timeout=0)
            except RingEmpty:
                break
            for pub_id, status, _ in batch.tolist():
                entry = self._pending.pop(pub_id, None)
                if entry is None:
                    continue  # released by its deadline already
                what = CAPTURE_STATUS.get(status, f"status {status}")
                self._released.append(Completion(entry.seq_id, entry.blocks, what))
                if status == STATUS_OK:
                    self.counters.completed += 1
                else:
                    self.counters.capture_failed[what] += 1

    def poll_completions(self) -> list[Completion]:
        """Publications whose blocks the engine may reuse now: captured (acknowledged:
        their root reaches the store), failed, or past their deadline ("expired")."""
        try:
            conn = self._connection()
            if conn is not None:
                self._poll(conn)
        except Exception:
            log.exception("completion poll failed")
            self._disconnect()
        now = time.monotonic()
        for pub_id in [p for p, e in self._pending.items() if e.deadline <= now]:
            entry = self._pending.pop(pub_id)
            self._released.append(Completion(entry.seq_id, entry.blocks, "expired"))
            self.counters.released_by_deadline += 1
        released, self._released = self._released, []
        return released

    @property
    def pending(self) -> int:
        """Publications whose blocks are still held."""
        return len(self._pending)

    # ---------------------------------------------------------------- read side

    def _open_store(self) -> PageStore | None:
        if self._store is None:
            # Never flushes touches itself (they go to commit), hence the infinite batch.
            self._store = PageStore(
                self.cfg.store_dir, self.rank, lease_seconds=self.cfg.lease_seconds, create=False,
                touch_batch=2**62, touch_interval_s=float("inf"),
            )
        return self._store

    def _keys(self, token_ids: Sequence[int] | np.ndarray,
              extra: KeyExtras | None = None) -> list[str]:
        assert self._reg is not None
        if extra is not None and not isinstance(extra, KeyExtras):
            raise TypeError(f"extra must be a KeyExtras or None, not {type(extra).__name__}")
        return list(sequence_keys(self._reg.namespace, token_ids, extra).all())

    def lookup(self, token_ids: Sequence[int] | np.ndarray, *,
               extra: KeyExtras | None = None) -> int:
        """Tokens of ``token_ids`` (with the request's ``extra``) whose pages the store
        holds (a prefix); 0 on any fault."""
        try:
            if self.cfg.access_mode is AccessMode.OFF or self._reg is None:
                return 0
            self.counters.lookups += 1
            store = self._open_store()
            pages = store.lookup(self._keys(token_ids, extra)) if store else 0
            return min(pages * self.cfg.page_tokens, len(token_ids))
        except Exception:
            log.exception("lookup failed")
            self.counters.misses["error"] += 1
            return 0

    def restore(self, token_ids: Sequence[int] | np.ndarray, block_ids: Sequence[int], *,
                extra: KeyExtras | None = None) -> int:
        """Read the stored prefix of ``token_ids`` (with the request's ``extra``) into
        ``block_ids`` of the registered tensors; the number of tokens restored (0 on any
        fault)."""
        try:
            return self._restore(token_ids, block_ids, extra)
        except Exception:
            log.exception("restore failed")
            self.counters.misses["error"] += 1
            return 0

    def _restore(self, token_ids: Sequence[int] | np.ndarray, block_ids: Sequence[int],
                 extra: KeyExtras | None = None) -> int:
        reg = self._reg
        if self.cfg.access_mode is AccessMode.OFF or reg is None:
            return 0
        keys = self._keys(token_ids, extra)[: len(block_ids)]
        if any(not 0 <= b < reg.views.num_blocks for b in block_ids[: len(keys)]):
            self.counters.misses["bad_block"] += 1
            return 0
        store = self._open_store()
        if store is None or not keys:
            return 0
        pbytes = reg.views.page_bytes
        if self._scratch.size < len(keys) * pbytes:
            self._scratch = np.empty(len(keys) * pbytes, np.uint8)
        rows = self._scratch[: len(keys) * pbytes].reshape(len(keys), pbytes)
        got = store.restore(keys, list(rows))
        for i in range(got):
            reg.views.scatter(int(block_ids[i]), rows[i])
        self.counters.restored_pages += got
        if got < len(keys):
            self.counters.misses["not_stored"] += 1
        self._send_touches(store)
        return min(got * self.cfg.page_tokens, len(token_ids))

    def _send_touches(self, store: PageStore) -> None:
        touches = store.take_touches()
        conn = self._connection()
        for key, pos, when in touches:
            try:
                if conn is None:
                    raise RingFull("not connected")
                conn.touch.try_push((*split_key(key), pos, when))
            except RingFull:
                # Only an access time is lost; its lease then ends a little early.
                self.counters.touches_dropped += 1

    def close(self) -> None:
        """Detach from the rings (without closing them: a new client may attach)."""
        try:
            self._disconnect()
            if self._store is not None:
                self._store.close()
                self._store = None
        except Exception:
            log.exception("client close failed")
