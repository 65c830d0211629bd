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

    def write(self, fd: int, pieces: list[memoryview]) -> int:
        lo = self.guard.ctypes.data
        for p in pieces:
            addr = np.frombuffer(p, np.uint8).ctypes.data if p.nbytes else 0
            if lo <= addr < lo + self.guard.size:
                raise OSError(errno.ENODATA, "page was not captured (collected meanwhile)")
        return super().write(fd, pieces)


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
            cfg.store_dir, spec.rank, lease_seconds=cfg.lease_seconds, fileops=self.ops,
            hook=lifecycle.checkpoint,
        )

    def close(self) -> None:
        self.store.close()
        self.filled.close()
        self.touch.close()
        self.freed.detach()
        self.arena.close()

    def run(self) -> None:
        # Recovery before READY: slots a dead predecessor held (committed or not) go first.
        # Records behind them in the ring are newer publications, maybe later turns of the
        # same sequence, which a redo after them would replace with the older turn.
        self._commit_held(time.monotonic())
        self.life.serve(self._step, POLL_S)
        self._step(0)
        self._commit_held(time.monotonic())  # whatever capture handed over before we stop

    def _step(self, timeout: float) -> None:
        try:
            for slot, _, generation in self.filled.pop_batch(256, timeout=timeout).tolist():
                lifecycle.checkpoint("commit.popped")
                st = self.arena.state[slot]
                if int(st["owner"]) == OWNER_COMMIT and int(st["generation"]) == generation:
                    # Held slots handed over before this one go first: one whose record a
                    # dead capture never pushed may hold an earlier turn of the same root.
                    # Its bytes are visible here: the same capture wrote them before this
                    # record's post, or a dead one before its successor was started.
                    self._commit_held(float(st["since"]))
        except (RingEmpty, RingClosed, SignalError):
            pass
        self._commit_held(time.monotonic() - ORPHAN_AFTER_S)
        self._touches()

    def _commit_held(self, until: float) -> None:
        """Commit every slot this role holds that was handed over at ``until`` or before,
        in hand-over order: two turns of a sequence share a root, and the later turn must
        be committed last. (``since`` is CLOCK_MONOTONIC, one clock for every process.)"""
        held = [
            i for i in range(self.arena.slots)
            if int(self.arena.state[i]["owner"]) == OWNER_COMMIT
            and float(self.arena.state[i]["since"]) <= until
        ]
        for slot in sorted(held, key=lambda j: float(self.arena.state[j]["since"])):
            self._commit_slot(slot)

    def _commit_slot(self, slot: int) -> None:
        buf = self.arena.slot_array(slot)
        try:
            contents = slotfmt.read(buf)
            guard = self.ops.ensure(contents.page_bytes)
            pages = [
                PageData(
                    join_key(hi, lo),
                    guard if copied < 0 else contents.pieces(buf, copied),
                )
                for hi, lo, copied in contents.entries.tolist()
            ]
            root_id = join_key(*contents.root)
            result = self.store.commit(Root(root_id, pages))
            self.life.processed += 1
            log.debug("committed %s: %s", root_id, result)
        except (CommitFailed, ValueError) as exc:
            self.life.failed += 1
            log.warning("slot %d not committed: %s", slot, exc)
        lifecycle.checkpoint("commit.committed")
        self.arena.hand_over(slot, OWNER_COMMIT, FREE)
        lifecycle.checkpoint("commit.slot_freed")
        try:
            self.freed.try_push((slot, 0, int(self.arena.state[slot]["generation"])))
        except RingFull:
            log.warning("freed ring full; capture finds slot %d by its owner", slot)

    def _touches(self) -> None:
        try:
            batch = self.touch.pop_batch(4096, timeout=0)
        except (RingEmpty, RingClosed, SignalError):
            return
        lifecycle.checkpoint("commit.touches")
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
