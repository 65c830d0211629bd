"""The maintenance worker of one rank: ``reconcile()`` at start, then keeps used bytes
under ``max_bytes`` by evicting LRU unleased roots toward the low watermark and
collecting unreferenced objects. Every pass is bounded (``VICTIMS`` roots and
``COLLECT`` objects, index walks only: no pass reads the whole inventory); the per-slice
time budget and duty cycle are the next issue's."""

from __future__ import annotations

import logging

from sparkcache.store import PageStore
from workers import lifecycle
from workers.lifecycle import Lifecycle, State, WorkerSpec

log = logging.getLogger(__name__)

VICTIMS = 16
COLLECT = 256
IDLE_S = 0.2


def _pass(store: PageStore, life: Lifecycle, evicting: bool) -> tuple[bool, bool]:
    """One bounded slice; (still evicting, did any work)."""
    cfg = life.spec.cfg
    usage = store.usage()
    if usage.used_bytes > cfg.max_bytes:
        evicting = True
    worked = False
    if evicting:
        victims = store.select_victims(VICTIMS)
        if victims:
            store.remove_roots(victims)
            worked = True
    if usage.collectable_objects or worked:
        worked = store.collect(COLLECT).objects > 0 or worked
    usage = store.usage()
    if usage.used_bytes <= cfg.low_watermark_bytes:
        evicting = False
    life.used_bytes = usage.used_bytes
    life.backlog = max(0, usage.used_bytes - cfg.low_watermark_bytes)
    life.processed += 1
    return evicting, worked


def _body(life: Lifecycle) -> None:
    cfg = life.spec.cfg
    store = PageStore(
        cfg.store_dir, life.spec.rank, lease_seconds=cfg.lease_seconds, hook=lifecycle.checkpoint
    )
    try:
        store.reconcile()
        life.to(State.READY)
        evicting = False
        while not life.stop:
            evicting, worked = _pass(store, life, evicting)
            life.beat()
            if not worked:
                life.idle(IDLE_S)
        life.to(State.DRAINING)
    finally:
        store.close()


def run(spec: WorkerSpec) -> None:
    lifecycle.main(spec, _body)
