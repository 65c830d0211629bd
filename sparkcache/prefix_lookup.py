"""``PrefixLookup``: how much of a request's prefix every tensor-parallel rank holds,
leased, asked from a process that holds no KV tensors (vLLM's scheduler).

A prefix is usable only if every rank can restore it, so the answer is the shortest
stored prefix across ranks. Each rank's index is read through a read-only
``StoreReader`` under that rank's lookup gate (shared), and the prefix found is leased
through the rank's ``lease`` ring before the gates are released: maintenance drains that
ring inside its eviction transaction, which takes the gate exclusively, so no eviction
can fall between the read and the lease (see ``sparkcache/store/gate.py``). A fault
anywhere is a miss, counted by reason, never an exception.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence

from sparkcache import runtime, segments
from sparkcache.config import AccessMode, Config
from sparkcache.engine_stats import (
    SLOT_LOOKUP,
    WRITE_INTERVAL_S,
    EngineStatsWriter,
    lookup_fields,
)
from sparkcache.protocol import RequestKind, worker_alive
from sparkcache.ratelog import RateLimitedLog
from sparkcache.shm import Producer, RingFull, StatsBlock
from sparkcache.shm.layouts import split_key
from sparkcache.store.reader import StoreReader
from sparkcache.workers.lifecycle import Role

log = logging.getLogger(__name__)

RETRY_INTERVAL_S = 1.0
# How long a check that maintenance is alive answers for, for a caller that looks up
# often (vLLM's scheduler: ``alive_recheck_s``). A check reads and verifies its whole
# stats record, ~30-45 µs of a scheduling step on cold caches; its answer is already as
# old as the heartbeat, which goes stale only after ``heartbeat_timeout_s`` (seconds).
ALIVE_RECHECK_S = 0.25


class MaintenanceDown(RuntimeError):
    """A rank's maintenance worker, which takes the leases, is not running."""


class PrefixLookup:
    """Leased lookups of key chains across ``tp_size`` ranks of one instance."""

    def __init__(self, cfg: Config, tp_size: int, *, alive_recheck_s: float = 0.0) -> None:
        """``alive_recheck_s``: maintenance is checked alive at most this often (0: at
        every lookup); see ``ALIVE_RECHECK_S``."""
        self.cfg = cfg
        self._alive_recheck_s = alive_recheck_s
        self.tp_size = tp_size
        self.misses: Counter = Counter()
        self.lookups = 0
        self.lookup_tokens = 0  # tokens asked about beyond the caller's own
        self.hit_tokens = 0  # of those, tokens found and leased
        self.releases_dropped = 0  # releases no ring took (``release``)
        # Rank 0's engine stats block: one scheduler serves every rank.
        self._engine: EngineStatsWriter | None = None
        self._engine_at = 0.0
        self._readers: list[StoreReader | None] = [None] * tp_size
        self._leases: list[Producer | None] = [None] * tp_size
        self._stats: list[StatsBlock | None] = [None] * tp_size
        self._retry_at = 0.0
        # The supervisor runtime.json named when its segments were attached here.
        self._supervisor: tuple | None = None
        # Until when maintenance counts as alive on every rank without a new check.
        self._alive_until = 0.0
        self._log = RateLimitedLog(log)

    def _reader(self, rank: int) -> StoreReader:
        reader = self._readers[rank]
        if reader is None:
            reader = self._readers[rank] = StoreReader(self.cfg.store_dir, rank)
        return reader

    def _lease_ring(self, rank: int) -> Producer:
        ring = self._leases[rank]
        if ring is None:
            ring = self._leases[rank] = segments.producer(self.cfg, rank, "lease")
        return ring

    def _maintenance_alive(self, rank: int) -> bool:
        """Whether the worker that takes this rank's leases is running. A stopped
        supervisor's rings are still mapped here: without this check leases would go
        into a ring nobody reads, until it filled (and a new supervisor's store never
        saw them)."""
        stats = self._stats[rank]
        if stats is None:
            # Once per supervisor (its segments are attached again after one stops):
            # leases go through rings whose ends are judged by pid (OtherNamespace).
            rt = runtime.read(self.cfg.store_dir)
            runtime.check_namespace(rt)
            stats = self._stats[rank] = segments.attach_stats(self.cfg, rank)
            self._supervisor = runtime.supervisor_identity(rt)
        return worker_alive(stats.read(int(Role.MAINTENANCE)), self.cfg.heartbeat_timeout_s)

    def lookup(self, keys: Sequence[str], beyond: int = 0, hints: Sequence[int] = (),
               lease: int = 0, counted: bool = True) -> int:
        """Leading ``keys`` every rank holds, leased as read lease ``lease``
        (``protocol.new_lease_id``; 0: an anonymous one) until the load given that lease
        ends (``SparkCacheClient.load_keys``) or ``release``, or for
        ``lookup_lease_seconds`` at most; 0 if
        they are not more than ``beyond`` (the pages the caller has already: one probe
        per rank tells), and 0 on any fault (a miss, counted in ``misses`` by reason).
        ``hints``: answers the caller expects, tried first (``chained_prefix``).
        ``counted=False``: not counted in the hit rate (``lookups``, ``lookup_tokens``,
        ``hit_tokens``) until the caller does so with ``count``."""
        if self.cfg.access_mode is AccessMode.OFF or len(keys) <= beyond:
            return 0
        now = time.monotonic()
        keep = False  # maintenance is down under the supervisor the handles belong to
        pages = 0
        try:
            if now < self._retry_at:
                self.misses["unavailable"] += 1
                return 0
            try:
                try:
                    pages = self._lookup(keys, beyond, hints, now, lease)
                except Exception as exc:
                    keep = isinstance(exc, MaintenanceDown) and self._same_supervisor()
                    if keep or not self._attached():
                        raise
                    # Handles of a supervisor since replaced (an upgrade, a restart):
                    # asked again at once through fresh ones, the first lookup after a
                    # restart is answered instead of missing, and the next second's
                    # with it.
                    self.close()
                    pages = self._lookup(keys, beyond, hints, now, lease)
            except Exception as exc:
                # A store not created yet, a supervisor gone, its maintenance down: try
                # again a little later. Every handle is dropped (a new supervisor makes
                # new rings, and a handle that faulted is opened afresh) unless only
                # maintenance is down and runtime.json still names the supervisor they
                # belong to, which restarts it in place: opening them all again on the
                # scheduler's thread would find the same segments.
                self._log.warning("unavailable", "prefix lookups miss: %s", exc)
                self.misses["unavailable"] += 1
                self._retry_at = now + RETRY_INTERVAL_S
                if not keep:
                    self.close()
                return 0
            return pages
        finally:
            if counted:
                self.count(len(keys), beyond, pages)
            self._publish_counters(now)

    def count(self, keys: int, beyond: int, pages: int) -> None:
        """Count a lookup of ``keys`` pages beyond the caller's ``beyond`` that found
        ``pages`` (a lookup made with ``counted=False``, whose answer stood)."""
        self.lookups += 1
        self.lookup_tokens += (keys - beyond) * self.cfg.page_tokens
        if pages > beyond:
            self.hit_tokens += (pages - beyond) * self.cfg.page_tokens

    def _same_supervisor(self) -> bool:
        """Whether runtime.json names the supervisor whose segments are attached here."""
        return self._supervisor is not None and runtime.names_supervisor(
            self.cfg.store_dir, self._supervisor)

    def _attached(self) -> bool:
        """Whether any handle of a supervisor's segments or of the store is open."""
        return any(h is not None for h in (*self._readers, *self._leases, *self._stats))

    def _fields(self) -> dict[str, float]:
        return lookup_fields(self.lookups, self.lookup_tokens, self.hit_tokens, self.misses)

    def publish_counters(self) -> None:
        """Write the counters if a write is due: for a caller that steps (vLLM's
        scheduler), so the last lookups before a quiet spell reach the supervisor."""
        self._publish_counters(time.monotonic())

    def _publish_counters(self, now: float) -> None:
        """Copy the counters into rank 0's engine stats block for the supervisor's
        /metrics, at most once per ``engine_stats.WRITE_INTERVAL_S``; the block is
        attached (or found missing) no more often than that either."""
        if self._engine is None:
            if now < self._engine_at:
                return
            self._engine_at = now + WRITE_INTERVAL_S
            self._engine = EngineStatsWriter.attach(self.cfg, 0, SLOT_LOOKUP)
            if self._engine is None:
                return
        self._engine.write_due(self._fields)

    def _lookup(self, keys: Sequence[str], beyond: int, hints: Sequence[int],
                now: float, lease: int) -> int:
        if now >= self._alive_until:
            # A lease taken in the interval after maintenance died is lost, as one taken
            # a moment before its death would be: the load misses and is recomputed.
            if not all(self._maintenance_alive(r) for r in range(self.tp_size)):
                raise MaintenanceDown("no maintenance worker running: no supervisor, or stopped")
            self._alive_until = now + self._alive_recheck_s
        readers = [self._reader(r) for r in range(self.tp_size)]
        held = []
        try:
            for reader in readers:
                if not reader.gate.try_shared():
                    self.misses["evicting"] += 1
                    return 0
                held.append(reader)
            pages = len(keys)
            for reader in readers:
                pages = reader.lookup(keys[:pages], beyond, hints)
                if not pages:
                    self.misses["not_stored"] += 1
                    return 0
            if not self._lease(keys[pages - 1], pages - 1, lease):
                return 0
            return pages
        finally:
            for reader in held:
                reader.gate.release()

    def _lease(self, key: str, pos: int, lease: int) -> bool:
        """Lease the prefix ending at ``key`` (page ``pos``) on every rank; False (a miss)
        if any rank's ring cannot take it at once."""
        record = (int(RequestKind.LEASE), 0, *split_key(key), pos, lease, time.time(),
                  self.cfg.lookup_lease_seconds)
        for rank in range(self.tp_size):
            try:
                self._lease_ring(rank).try_push(record)
            except RingFull:
                self.misses["no_lease"] += 1
                return False
        return True

    def release(self, lease: int) -> None:
        """End read lease ``lease`` on every rank, for a lookup whose load will not come
        (the request went before it): through the ring its lease took, so the lease is
        always taken first. Never raises: a release that cannot be sent leaves the lease
        to end at its bound, counted in ``releases_dropped``."""
        if not lease:
            return
        record = (int(RequestKind.RELEASE), 0, 0, 0, 0, lease, time.time(), 0.0)
        for ring in self._leases:
            try:
                if ring is not None:
                    ring.try_push(record)
            except Exception:
                self.releases_dropped += 1

    def close(self) -> None:
        self._alive_until = 0.0
        self._supervisor = None
        if self._engine is not None:
            # What was counted since the last write reaches the block (this supervisor's,
            # or a stopped one's, where it is harmless).
            self._engine.write_due(self._fields, force=True)
            self._engine.close()
            self._engine = None
        for i, reader in enumerate(self._readers):
            if reader is not None:
                try:
                    reader.close()
                except Exception:
                    log.debug("closing a store reader failed", exc_info=True)
                self._readers[i] = None
        for i, stats in enumerate(self._stats):
            if stats is not None:
                stats.close()
                self._stats[i] = None
        for i, ring in enumerate(self._leases):
            if ring is not None:
                try:
                    ring.detach()
                except Exception:
                    log.debug("detaching a lease ring failed", exc_info=True)
                self._leases[i] = None
