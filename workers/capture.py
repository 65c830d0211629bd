"""The capture worker of one rank: publish ring -> capture slot -> commit.

Per publication: check its deadline and registration, bounds-check every block id
against the registered geometry, ask the store which leading pages it already holds,
copy only the rest (the page delta) into a free slot, re-check the deadline (a copy that
ended late may have raced the engine reusing the blocks: dropped), hand the slot to
commit and tell the engine its blocks are free. Statuses travel on the completion ring.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from posix_ipc import SignalError

from shm import FREE, RingClosed, RingEmpty, RingFull
from shm.layouts import join_key
from sparkcache import kvmem, segments
from sparkcache.segments import OWNER_CAPTURE, OWNER_COMMIT
from sparkcache.store import PageStore
from workers import lifecycle, slotfmt
from workers.lifecycle import Lifecycle, WorkerSpec
from workers.prefault import Prefaulter

log = logging.getLogger(__name__)

OK, EXPIRED, UNREGISTERED, BAD_BLOCK, NO_SLOT, TOO_LARGE, FAILED = range(7)
POLL_S = 0.2


@dataclass
class _Registered:
    reg_gen: int
    opened: kvmem.OpenedTensors
    views: kvmem.BlockViews


class Capture:
    def __init__(self, life: Lifecycle) -> None:
        spec = life.spec
        cfg = spec.cfg
        self.life = life
        self.cfg = cfg
        self.rank = spec.rank
        self.arena = segments.attach_arena(cfg, spec.rank)
        self.publish = segments.consumer(cfg, spec.rank, "publish")
        self.completion = segments.producer(cfg, spec.rank, "completion")
        self.filled = segments.producer(cfg, spec.rank, "filled")
        self.freed = segments.consumer(cfg, spec.rank, "freed")
        self.store = PageStore(cfg.store_dir, spec.rank, lease_seconds=cfg.lease_seconds)
        self.reg: _Registered | None = None
        # Slots a dead predecessor was filling are ours to free: nobody else takes them.
        for i in range(self.arena.slots):
            if int(self.arena.state[i]["owner"]) == OWNER_CAPTURE:
                self.arena.hand_over(i, OWNER_CAPTURE, FREE)
        self.free = set(self.arena.free_slots())
        # Fault the slots in behind READY (tmpfs allocates a page on first touch), so the
        # first publications need not pay for it inside their deadline.
        self.prefault = Prefaulter(self.arena, lambda n: setattr(life, "prefaulted_bytes", n))

    def close(self) -> None:
        self.prefault.stop()
        if self.reg is not None:
            self.reg.opened.close()
        self.store.close()
        self.publish.close()
        self.freed.close()
        self.completion.detach()
        self.filled.detach()
        self.arena.close()

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        self.life.serve(self._step, POLL_S)
        # Publications already queued are still taken: their blocks are held meanwhile.
        while self._step(0):
            pass

    def _step(self, timeout: float) -> bool:
        """Handle the publications waiting in the ring; False when there were none."""
        try:
            batch = self.publish.pop_batch(self.publish_capacity(), timeout=timeout)
        except (RingEmpty, RingClosed, SignalError):
            return False
        starts = np.flatnonzero(batch["page_index"] == 0)
        for s in starts:
            n = int(batch["npages"][s])
            recs = batch[s : s + n]
            if len(recs) != n or not (recs["pub_id"] == recs["pub_id"][0]).all():
                log.error("publication %d arrived torn; dropped", int(batch["pub_id"][s]))
                continue
            status, copied = self._capture(recs)
            if status != OK:
                self.life.failed += 1
            try:
                self.completion.try_push((int(recs["pub_id"][0]), status, copied))
            except RingFull:
                log.warning("completion ring full; the client releases by deadline")
        return True

    def publish_capacity(self) -> int:
        return segments.RINGS["publish"][1]

    # ------------------------------------------------------------------ one publication

    def _registration(self, reg_gen: int) -> _Registered | None:
        if self.reg is not None and self.reg.reg_gen == reg_gen:
            return self.reg
        desc = kvmem.read_registry(self.cfg.store_dir, self.rank)
        if desc is None or desc["reg_gen"] != reg_gen:
            return None
        if self.reg is not None:
            self.reg.opened.close()
            self.reg = None
        opened = kvmem.open_tensors(desc)
        self.reg = _Registered(
            reg_gen, opened, kvmem.BlockViews(opened.tensors, int(desc["block_dim"]))
        )
        return self.reg

    def _take_slot(self, deadline: float) -> int | None:
        timeout = 0.0
        while True:
            try:
                for slot, _, _ in self.freed.pop_batch(256, timeout=timeout).tolist():
                    # A record may be stale (a slot freed before this worker started and
                    # taken since): only a slot still FREE is free.
                    if int(self.arena.state[slot]["owner"]) == FREE:
                        self.free.add(slot)
            except (RingEmpty, RingClosed, SignalError):
                if timeout:
                    self.life.beat()
            if not self.free:
                # A slot can be FREE without a record: commit died between handing it back
                # and pushing the record, or the ring was full. Only capture takes FREE
                # slots, so every FREE one is ours; without this it would be lost for good.
                self.free.update(self.arena.free_slots())
            if self.free:
                return self.free.pop()
            left = deadline - time.monotonic()
            if left <= 0 or self.life.stop:
                return None
            timeout = min(left, POLL_S)

    def _capture(self, recs: np.ndarray) -> tuple[int, int]:
        deadline = float(recs["deadline"][0])
        if time.monotonic() >= deadline:
            return EXPIRED, 0
        reg = self._registration(int(recs["reg_gen"][0]))
        if reg is None:
            return UNREGISTERED, 0
        blocks = recs["block_id"]
        if (blocks < 0).any() or (blocks >= reg.views.num_blocks).any():
            log.warning("publication with block ids outside 0-%d refused",
                        reg.views.num_blocks - 1)
            return BAD_BLOCK, 0
        keys = [join_key(h, lo) for h, lo in zip(recs["key_hi"], recs["key_lo"], strict=True)]
        n = len(keys)
        stored = self.store.lookup(keys)
        if slotfmt.needed(n, n - stored, reg.views.run_bytes) > self.arena.slot_bytes:
            return TOO_LARGE, 0
        slot = self._take_slot(deadline)
        if slot is None:
            return NO_SLOT, 0
        self.arena.hand_over(slot, FREE, OWNER_CAPTURE)
        lifecycle.checkpoint("capture.slot_taken")
        try:
            status = self._fill(slot, recs, reg, stored, deadline)
        except Exception:
            log.exception("capture of publication %d failed", int(recs["pub_id"][0]))
            status = FAILED
        if status != OK:
            self.arena.hand_over(slot, OWNER_CAPTURE, FREE)
            self.free.add(slot)
            return status, 0
        return OK, n - stored

    def _fill(self, slot: int, recs: np.ndarray, reg: _Registered, stored: int,
              deadline: float) -> int:
        n, runs = len(recs), reg.views.run_bytes
        buf = self.arena.slot_array(slot)
        # CPU time, not wall: on a host without spare cores the wall clock would also
        # count the time the scheduler gave the engine or commit.
        t0 = time.thread_time()
        reg.views.gather_runs(recs["block_id"][stored:].tolist(),
                              slotfmt.data(buf, n, n - stored, runs))
        self.life.copy_seconds += time.thread_time() - t0
        self.life.copy_bytes += (n - stored) * reg.views.page_bytes
        if time.monotonic() >= deadline:
            return EXPIRED  # the engine may have reused the blocks while we copied
        root = (int(recs["root_hi"][0]), int(recs["root_lo"][0]))
        slotfmt.write_header(buf, int(recs["pub_id"][0]), root, recs, stored, runs)
        used = slotfmt.needed(n, n - stored, runs)
        lifecycle.checkpoint("capture.copied")
        self.arena.hand_over(slot, OWNER_CAPTURE, OWNER_COMMIT, used)
        lifecycle.checkpoint("capture.handed")
        generation = int(self.arena.state[slot]["generation"])
        try:
            self.filled.try_push((slot, 0, generation))
        except RingFull:
            log.warning("filled ring full; commit finds slot %d by its owner", slot)
        lifecycle.checkpoint("capture.filled")
        self.life.processed += 1
        return OK


def _body(life: Lifecycle) -> None:
    torch.set_num_threads(1)  # one pinned core: no thread pool fighting the engine
    cap = Capture(life)
    try:
        cap.run()
    finally:
        cap.close()


def run(spec: WorkerSpec) -> None:
    lifecycle.main(spec, _body)
