"""The commit worker of one rank: filled slot -> ``PageStore.commit`` -> slot FREE.

A slot is committed when its ``filled`` record arrives (the ring orders the slot's bytes)
or, for a slot this role has held for a while without a record (a predecessor died
after popping it, or capture died before pushing it), from the slot alone: committing a
root twice stores the same root, so a redo is harmless. Pages capture did not copy (the
store held them) are given to the store as a guard buffer that refuses to be written: if
such a page was collected in between, the commit fails rather than store wrong bytes.
Also applies the access touches that clients' restores send.
"""

from __future__ import annotations

import errno
import logging
import time

import numpy as np
from posix_ipc import SignalError

from shm import FREE, RingClosed, RingEmpty, RingFull
from shm.layouts import join_key
from sparkcache import segments
from sparkcache.segments import OWNER_COMMIT
from sparkcache.store import CommitFailed, PageData, PageStore, Root
from sparkcache.store.fileops import FileOps
from workers import lifecycle, slotfmt
from workers.lifecycle import Lifecycle, WorkerSpec

log = logging.getLogger(__name__)

POLL_S = 0.1
# A slot held by commit this long without a ring record is committed from the slot alone.
ORPHAN_AFTER_S = 1.0


class _GuardedOps(FileOps):
    """Refuses to write bytes of the guard buffer (a page capture did not copy)."""

    def __init__(self) -> None:
        self.guard = np.zeros(0, np.uint8)

    def ensure(self, size: int) -> np.ndarray:
        if self.guard.size < size:
            self.guard = np.zeros(size, np.uint8)
        return self.guard[:size]

    def write(self, fd: int, data: memoryview) -> int:
        if len(data):
            lo = self.guard.ctypes.data
            addr = np.frombuffer(data, np.uint8).ctypes.data
            if lo <= addr < lo + self.guard.size:
                raise OSError(errno.ENODATA, "page was not captured (collected meanwhile)")
        return super().write(fd, data)


class Commit:
    def __init__(self, life: Lifecycle) -> None:
        spec = life.spec
        cfg = spec.cfg
        self.life = life
        self.arena = segments.attach_arena(cfg, spec.rank)
        self.filled = segments.consumer(cfg, spec.rank, "filled")
        self.freed = segments.producer(cfg, spec.rank, "freed")
        self.touch = segments.consumer(cfg, spec.rank, "touch")
        self.ops = _GuardedOps()
        self.store = PageStore(
            cfg.store_dir, spec.rank, lease_seconds=cfg.lease_seconds, fileops=self.ops
        )

    def close(self) -> None:
        self.store.close()
        self.filled.close()
        self.touch.close()
        self.freed.detach()
        self.arena.close()

    def run(self) -> None:
        self.life.serve(self._step, POLL_S)
        self._step(0)
        self._orphans(0.0)  # whatever capture handed over before we stop

    def _step(self, timeout: float) -> None:
        try:
            for slot, _, generation in self.filled.pop_batch(256, timeout=timeout).tolist():
                st = self.arena.state[slot]
                if int(st["owner"]) == OWNER_COMMIT and int(st["generation"]) == generation:
                    self._commit_slot(slot)
        except (RingEmpty, RingClosed, SignalError):
            pass
        self._orphans(ORPHAN_AFTER_S)
        self._touches()

    def _orphans(self, older_than: float) -> None:
        now = time.time()
        for i in range(self.arena.slots):
            st = self.arena.state[i]
            if int(st["owner"]) == OWNER_COMMIT and now - float(st["since"]) >= older_than:
                self._commit_slot(i)

    def _commit_slot(self, slot: int) -> None:
        buf = self.arena.slot_array(slot)
        head = buf[: slotfmt.HEAD.itemsize].view(slotfmt.HEAD)[0]
        try:
            if int(head["magic"]) != slotfmt.MAGIC:
                raise ValueError(f"slot {slot} has no publication header")
            n, pbytes = int(head["npages"]), int(head["page_bytes"])
            _, entries = slotfmt.views(buf, n)
            guard = self.ops.ensure(pbytes)
            pages = [
                PageData(
                    join_key(e["key_hi"], e["key_lo"]),
                    guard if e["offset"] < 0 else buf[e["offset"] : e["offset"] + pbytes],
                )
                for e in entries
            ]
            root_id = join_key(head["root_hi"], head["root_lo"])
            result = self.store.commit(Root(root_id, pages))
            self.life.processed += 1
            log.debug("committed %s: %s", root_id, result)
        except (CommitFailed, ValueError) as exc:
            self.life.failed += 1
            log.warning("slot %d not committed: %s", slot, exc)
        self.arena.hand_over(slot, OWNER_COMMIT, FREE)
        try:
            self.freed.try_push((slot, 0, int(self.arena.state[slot]["generation"])))
        except RingFull:
            log.warning("freed ring full; capture rescans free slots when it restarts")

    def _touches(self) -> None:
        try:
            batch = self.touch.pop_batch(4096, timeout=0)
        except (RingEmpty, RingClosed, SignalError):
            return
        for hi, lo, pos, when in batch.tolist():
            self.store.record_access(join_key(hi, lo), int(pos), when)
        self.store.flush_touches()  # one transaction per popped batch


def _body(life: Lifecycle) -> None:
    c = Commit(life)
    try:
        c.run()
    finally:
        c.close()


def run(spec: WorkerSpec) -> None:
    lifecycle.main(spec, _body)
