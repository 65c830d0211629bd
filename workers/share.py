"""The share worker of one rank: durable pages -> the fleet's Redis Cluster
(docs/fleet.md), never on the engine's path.

It reads the rank's index (read-only, as the restore worker does: commit and maintenance
are its only writers) for the roots to share, newest first (``share_roots`` "all") or
only those restored at least once, most recently restored first ("hit"), and sends each
root's pages in batches of about ``BATCH_BYTES``: read and verified from the local store
like a restore, then ``fleet.pages.share`` (pages the cluster holds are not sent again,
by any node). Pacing as maintenance's: at most ``share_bytes_per_s`` sent on average and
``share_duty`` of any second spent in batches. What it has shared is remembered per root
for the process's life; after a restart the cluster's own answer (one pipelined
``EXISTS`` a page) says what is there, so nothing is sent twice.

A cluster that cannot be reached, or fails a batch, is logged once per kind, counted
(``failed``) and tried again after a back-off doubling from 1 s to 60 s; the rank serves
from its local store throughout. ``backlog`` is the bytes of the roots chosen that are
not yet known to be shared; ``processed`` the pages sent; ``copy_bytes`` the bytes sent.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from sparkcache.workers import lifecycle
from sparkcache.workers.lifecycle import Lifecycle, WorkerSpec

from sparkcache.fleet.cluster import ClusterSettings, connect
from sparkcache.fleet.pages import share
from sparkcache.maintenance_policy import DutyCycle, IoPacer
from sparkcache.ratelog import RateLimitedLog
from sparkcache.store.reader import StoreReader

log = logging.getLogger(__name__)

POLL_S = 1.0  # an idle worker looks for new roots this often
# The roots to share are listed again at most this often (and when those listed are
# done): a listing reads every root's row, which a batch must not pay each time.
LIST_EVERY_S = 5.0
BATCH_BYTES = 8 << 20  # pages read and sent in one batch, about
BATCH_S = 0.05  # a batch's time, for the duty cap's arithmetic
BACKOFF_S = (1.0, 60.0)  # after a failure: first wait, longest wait


@dataclass
class _Root:
    root_id: str
    pages: int
    bytes: int


class Share:
    def __init__(self, life: Lifecycle) -> None:
        cfg = life.spec.cfg
        self.life = life
        self.settings = ClusterSettings(
            cfg.share_cluster_url, key_prefix=cfg.share_key_prefix,
            username=cfg.share_username or None,
            password_file=Path(cfg.share_password_file) if cfg.share_password_file else None,
            tls_ca_file=Path(cfg.share_tls_ca_file) if cfg.share_tls_ca_file else None)
        self.hit_only = cfg.share_roots == "hit"
        self.reader = StoreReader(cfg.store_dir, life.spec.rank)
        self.cluster = None
        self.shared: dict[str, int] = {}  # root id -> leading pages the cluster holds
        self.retry_at = 0.0
        self.backoff = BACKOFF_S[0]
        self.duty = DutyCycle(cfg.share_duty, min(BATCH_S, cfg.share_duty))
        self.pacer = IoPacer(float(cfg.share_bytes_per_s), time.monotonic())
        self.roots: list[_Root] = []
        self.listed_at = -LIST_EVERY_S
        self._rare = RateLimitedLog(log)

    def close(self) -> None:
        self.reader.close()
        if self.cluster is not None:
            self.cluster.close()

    def step(self, timeout: float) -> None:
        now = time.monotonic()
        wait = max(self.retry_at - now, self.duty.wait(now), self.pacer.wait(now))
        if wait > 0:
            self.life.idle(min(wait, timeout))
            return
        todo = self._next_root(now)
        if todo is None:
            self.life.backlog = 0
            self.life.idle(timeout)
            return
        started = time.monotonic()
        try:
            self._share_batch(todo)
            self.backoff = BACKOFF_S[0]
        except Exception as exc:  # the cluster's faults: a miss for the fleet, no more
            self.life.failed += 1
            self._rare.warning(type(exc).__name__, "sharing with %s failed (%s); trying "
                               "again in %.0f s", self.settings.url, exc, self.backoff)
            self.retry_at = time.monotonic() + self.backoff
            self.backoff = min(BACKOFF_S[1], self.backoff * 2)
            if self.cluster is not None:
                self.cluster.close()
                self.cluster = None
        finally:
            self.duty.record(started, time.monotonic())

    def _next_root(self, now: float) -> _Root | None:
        """The first root listed with pages not yet shared; the roots are listed again
        (and the backlog reckoned) every ``LIST_EVERY_S``, and every ``POLL_S`` once
        those listed are done."""
        if now - self.listed_at >= (POLL_S if self._first_unshared() is None
                                    else LIST_EVERY_S):
            self.listed_at = now
            self.roots = [_Root(*r) for r in self.reader.roots(restored_only=self.hit_only)]
            live = {r.root_id for r in self.roots}
            for gone in [k for k in self.shared if k not in live]:
                del self.shared[gone]
            self.life.backlog = sum(r.bytes * (r.pages - self.shared.get(r.root_id, 0))
                                    // max(1, r.pages) for r in self.roots)
        return self._first_unshared()

    def _first_unshared(self) -> _Root | None:
        return next((r for r in self.roots if self.shared.get(r.root_id, 0) < r.pages), None)

    def _share_batch(self, root: _Root) -> None:
        if self.cluster is None:
            self.cluster = connect(self.settings)
            log.info("sharing with the cluster at %s (prefix %r)", self.settings.url,
                     self.settings.key_prefix)
        done = self.shared.get(root.root_id, 0)
        page_bytes = max(1, root.bytes // max(1, root.pages))
        n = max(1, BATCH_BYTES // page_bytes)
        keys = self.reader.root_keys(root.root_id, done, n)
        plan = self.reader.plan(keys)
        rows = np.empty((len(plan), max((p.size for p in plan), default=0)), np.uint8)
        read = self.reader.read_planned(plan, [rows[i, :p.size] for i, p in enumerate(plan)])
        if not keys or read.pages < len(keys):
            # Evicted meanwhile (or a page that fails verification, which the next
            # restore quarantines): the root is left for a later pass.
            self.shared[root.root_id] = root.pages
            return
        result = share(self.cluster, self.settings.key_prefix,
                       [(bytes.fromhex(p.key), rows[i, :p.size]) for i, p in enumerate(plan)])
        self.shared[root.root_id] = done + len(keys)
        self.life.processed += result.sent
        self.life.copy_bytes += result.bytes_sent
        self.pacer.charge(result.bytes_sent, time.monotonic())


def _body(life: Lifecycle) -> None:
    s = Share(life)
    try:
        life.serve(s.step, POLL_S)
    finally:
        s.close()


def run(spec: WorkerSpec) -> None:
    lifecycle.main(spec, _body)
