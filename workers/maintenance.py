"""The maintenance worker of one rank: ``reconcile()`` at start, then keeps used bytes
under ``max_bytes`` by evicting LRU unleased roots toward the low watermark and
collecting unreferenced objects; and it writes what the engine asks on the request ring
(the engine only reads the index): restore touches, lookup leases, quarantines.

Every pass is bounded (``VICTIMS`` roots and ``COLLECT`` objects, index walks only: no
pass reads the whole inventory); the per-slice time budget and duty cycle are the next
issue's. While evicting, the request ring is drained inside the eviction transaction
under the lookup gate (``sparkcache/store/gate.py``), so a lookup's lease is always
written before a removal could take what it counted.
"""

from __future__ import annotations

import logging
import math
import time

from posix_ipc import SignalError

from shm import Consumer, RingClosed, RingEmpty
from shm.layouts import join_key
from sparkcache import segments
from sparkcache.protocol import RequestKind
from sparkcache.store import PageStore
from workers import lifecycle
from workers.lifecycle import ENVIRONMENT_FAULTS, Lifecycle, State, WorkerSpec

log = logging.getLogger(__name__)

VICTIMS = 16
COLLECT = 256
IDLE_S = 0.2
# A request's page position is below the most pages one publication can carry.
_MAX_POS = segments.RINGS["publish"][1]
# Clocks of two processes: an access stamped this far in the future is still believed.
_FUTURE_SLACK_S = 60.0


class Maintenance:
    def __init__(self, life: Lifecycle) -> None:
        cfg = life.spec.cfg
        self.life = life
        self.cfg = cfg
        # The engine worker's requests, and the leases the vLLM scheduler's lookups take.
        self.requests = [segments.consumer(cfg, life.spec.rank, ring)
                         for ring in ("request", "lease")]
        self.store = PageStore(
            cfg.store_dir, life.spec.rank, lease_seconds=cfg.lease_seconds,
            hook=lifecycle.checkpoint,
        )
        self.evicting = False
        self._quarantines: list[tuple[str, str]] = []

    def close(self) -> None:
        self.store.close()
        for ring in self.requests:
            ring.close()

    def run(self) -> None:
        self.store.reconcile()
        self.life.to(State.READY)
        while not self.life.stop:
            try:
                worked = self._pass()
            except ENVIRONMENT_FAULTS:
                raise
            except Exception:
                self.life.item_error("a maintenance pass")
                self.store.check_usable()
                worked = False
            self.life.beat()
            if not worked:
                self.life.idle(IDLE_S)
        self.life.to(State.DRAINING)
        self._take_requests()
        self.store.flush_touches()

    def _pass(self) -> bool:
        """One bounded slice; True if it did any work."""
        cfg = self.cfg
        usage = self.store.usage()
        if usage.used_bytes > cfg.max_bytes:
            self.evicting = True
        worked = False
        if self.evicting:
            removed = self.store.evict(VICTIMS, self._take_requests)
            worked = bool(removed.removed)
        else:
            worked = self._take_requests() > 0
            self.store.flush_touches()
        for key, generation in self._quarantines:
            self.store.verify_and_quarantine(key, generation, "failed verification in a restore")
        self._quarantines = []
        if usage.collectable_objects or worked:
            worked = self.store.collect(COLLECT).objects > 0 or worked
        usage = self.store.usage()
        if usage.used_bytes <= cfg.low_watermark_bytes:
            self.evicting = False
        self.life.used_bytes = usage.used_bytes
        self.life.backlog = max(0, usage.used_bytes - cfg.low_watermark_bytes)
        self.life.processed += 1
        return worked

    def _take_requests(self) -> int:
        """Move every request in the rings into the store's batch (or the quarantine list);
        the number taken. Drains the rings whole: under the gate, what a finished lookup
        pushed must be in the batch."""
        return sum(self._take_from(ring) for ring in self.requests)

    def _take_from(self, ring: Consumer) -> int:
        taken = 0
        while True:
            try:
                batch = ring.pop_batch(4096, timeout=0)
            except (RingEmpty, RingClosed, SignalError):
                return taken
            lifecycle.checkpoint("maintenance.requests")
            now = time.time()
            for kind, _, hi, lo, arg, when, seconds in batch.tolist():
                taken += 1
                reason = self._check(kind, arg, when, seconds, now)
                if reason is not None:
                    self.life.drop("request", f"request of kind {kind} ({reason})")
                    continue
                key = join_key(hi, lo)
                if kind == RequestKind.TOUCH:
                    self.store.record_access(key, arg, when)
                elif kind == RequestKind.LEASE:
                    self.store.record_lease(key, arg, when + seconds)
                else:
                    self._quarantines.append((key, f"{arg:016x}"))

    @staticmethod
    def _check(kind: int, arg: int, when: float, seconds: float, now: float) -> str | None:
        """Why a request is malformed, or None."""
        if kind not in RequestKind.__members__.values():
            return "unknown kind"
        if kind == RequestKind.QUARANTINE:
            return None  # any 64 bits name a generation; an unknown object is ignored
        if arg >= _MAX_POS:
            return f"page position {arg}"
        if not (math.isfinite(when) and 0 < when <= now + _FUTURE_SLACK_S):
            return "access time"
        if kind == RequestKind.LEASE and not (math.isfinite(seconds) and 0 < seconds <= 3600):
            return "lease seconds"
        return None


def _body(life: Lifecycle) -> None:
    m = Maintenance(life)
    try:
        m.run()
    finally:
        m.close()


def run(spec: WorkerSpec) -> None:
    lifecycle.main(spec, _body)
