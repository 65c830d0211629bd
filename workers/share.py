"""The share worker of one rank: durable pages -> the fleet's Redis Cluster
(docs/fleet.md), never on the engine's path.

It reads the rank's index (read-only, as the restore worker does: commit and maintenance
are its only writers) for the roots to share, newest first (``share_roots`` "all") or
only those restored at least once, most recently restored first ("hit"), and sends each
root's pages in batches of about ``BATCH_BYTES``: read and verified from the local store
like a restore, framed in place and set where absent (``fleet.pages.send``), past the
pages the cluster held when the root was first seen (``fleet.pages.held``, a few
probes): a page the cluster holds is not sent again, by any node. Pacing as
maintenance's: at most ``share_bytes_per_s`` sent on average and ``share_duty`` of any
second spent in batches. What it has shared is remembered per root
for the process's life; after a restart the cluster's own answer says what is there.

A cluster that cannot be reached, or fails a batch, is logged once per kind, counted
(``failed``) and tried again after a back-off doubling from 1 s to 60 s; the rank serves
from its local store throughout. ``backlog`` is the bytes of the roots chosen that are
not yet known to be shared; ``processed`` the pages sent; ``copy_bytes`` the bytes sent.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from sparkcache.workers import lifecycle
from sparkcache.workers.lifecycle import Lifecycle, WorkerSpec

from sparkcache.fleet import codec
from sparkcache.fleet.link import ClusterLink, settings_of
from sparkcache.fleet.pages import held, send
from sparkcache.maintenance_policy import DutyCycle, IoPacer
from sparkcache.store.reader import StoreReader

log = logging.getLogger(__name__)

POLL_S = 1.0  # an idle worker looks for new roots this often
# The roots to share are listed again at most this often (and when those listed are
# done): a listing reads every root's row, which a batch must not pay each time.
LIST_EVERY_S = 5.0
BATCH_BYTES = 8 << 20  # pages read and sent in one batch, about
BATCH_S = 0.05  # a batch's time, for the duty cap's arithmetic


@dataclass
class _Root:
    root_id: str
    pages: int
    bytes: int


class Share:
    def __init__(self, life: Lifecycle) -> None:
        cfg = life.spec.cfg
        self.life = life
        self.link = ClusterLink(settings_of(cfg), f"share[r{life.spec.rank}]")
        self.hit_only = cfg.share_roots == "hit"
        self.reader = StoreReader(cfg.store_dir, life.spec.rank)
        self.shared: dict[str, int] = {}  # root id -> leading pages the cluster holds
        self.duty = DutyCycle(cfg.share_duty, min(BATCH_S, cfg.share_duty))
        self.pacer = IoPacer(float(cfg.share_bytes_per_s), time.monotonic())
        self.roots: list[_Root] = []
        self.listed_at = -LIST_EVERY_S

    def close(self) -> None:
        self.reader.close()
        self.link.close()

    def step(self, timeout: float) -> None:
        now = time.monotonic()
        wait = max(self.link.retry_at - now, self.duty.wait(now), self.pacer.wait(now))
        if wait > 0:
            self.life.idle(min(wait, timeout))
            return
        todo = self._next_root(now)
        if todo is None:
            self.life.backlog = 0
            self.life.idle(timeout)
            return
        started = time.monotonic()
        # The cluster's faults are a miss for the fleet, no more: counted, backed off.
        self.link.call(lambda cluster: self._share_batch(cluster, todo))
        self.life.failed = self.link.failures
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

    def _share_batch(self, cluster: Any, root: _Root) -> None:
        prefix, rank = self.link.settings.key_prefix, self.life.spec.rank
        if root.root_id not in self.shared:
            # First, how far the cluster holds this root already (another node's turn of
            # the same conversation, or this node's before a restart): a few probes.
            keys = self.reader.root_keys(root.root_id, 0, root.pages)
            self.shared[root.root_id] = held(cluster, prefix, (rank,),
                                             [bytes.fromhex(k) for k in keys])
            return
        done = self.shared[root.root_id]
        page_bytes = max(1, root.bytes // max(1, root.pages))
        n = max(1, BATCH_BYTES // page_bytes)
        keys = self.reader.root_keys(root.root_id, done, n)
        plan = self.reader.plan(keys)
        # Read after a header's room each, framed in place: sent without another copy.
        room = codec.HEADER.size
        rows = np.empty((len(plan), room + max((p.size for p in plan), default=0)), np.uint8)
        read = self.reader.read_planned(
            plan, [rows[i, room : room + p.size] for i, p in enumerate(plan)])
        if not keys or read.pages < len(keys):
            # Evicted meanwhile (or a page that fails verification, which the next
            # restore quarantines): the root is left for a later pass.
            self.shared[root.root_id] = root.pages
            return
        key_bytes = [bytes.fromhex(p.key) for p in plan]
        result = send(cluster, prefix, rank, [
            (key, codec.frame(rank, key, rows[i, : room + p.size]))
            for i, (key, p) in enumerate(zip(key_bytes, plan, strict=True))])
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
