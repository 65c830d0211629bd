"""The commit worker of one rank: filled slot -> ``PageStore.commit`` -> slot FREE, and
the durable acknowledgement of each root to the engine.

Which slots commit may read. Python cannot fence, and on arm64 a slot's owner may become
visible before the bytes capture wrote into it, so commit reads a slot only when a
synchronisation covers capture's writes or their writer is known dead:

* a ``filled`` record popped for (slot, generation): the ring's semaphore orders every
  write capture made before pushing it; that includes the slots the *same* capture
  process handed over earlier (it handles one publication at a time, in order), which
  commit therefore takes first, in hand-over order;
* a slot whose hand-over was made by a process that is now dead (the arena records its
  pid and start time): a dead process writes nothing more.

A slot commit held when it died, whose ``filled`` record it had already popped, is
therefore found again in one of two ways: its capture is dead (the second rule), or the
live capture pushes its record again (capture repeats the record of every slot it handed
over and still sees held by commit, after ``REMIND_AFTER_S``). Committing a root twice
stores the same root, so a redo is harmless; committing an older turn of a sequence after
a newer one is not, hence the hand-over order.

Pages capture did not copy (the store held them; capture leased them until this commit)
are given to the store as a guard buffer that refuses to be written: if such a page
vanished anyway, the commit fails rather than store wrong bytes.
"""

from __future__ import annotations

import errno
import logging
import time

import numpy as np
from posix_ipc import SignalError
from sparkcache.shm import FREE, RingClosed, RingEmpty, RingFull
from sparkcache.shm.arena import writer_dead
from sparkcache.shm.layouts import join_key, join_keys
from sparkcache.shm.segment import creator_alive
from sparkcache.workers import lifecycle, slotfmt
from sparkcache.workers.announce import SlotAnnouncer
from sparkcache.workers.lifecycle import ENVIRONMENT_FAULTS, Lifecycle, Role, WorkerSpec

from sparkcache import segments
from sparkcache.protocol import DurableStatus
from sparkcache.segments import OWNER_COMMIT
from sparkcache.store import CommitFailed, PageData, PageStore, Root, index
from sparkcache.store.fileops import FileOps
from sparkcache.store.space import is_disk_full

log = logging.getLogger(__name__)

POLL_S = 0.1
# Hand-over records the ring may hold: a batch larger than this is taken in several pops.
_POP = 256


class _GuardedOps(FileOps):
    """Refuses to write bytes of the guard buffer (a page capture did not copy). A piece
    is recognised by the array it views, not its address: one comparison a piece, where
    an address took two numpy calls (~1 s of a mission bench's commits)."""

    def __init__(self) -> None:
        self.guard = np.zeros(0, np.uint8)

    def ensure(self, size: int) -> np.ndarray:
        """The guard for pages of ``size`` bytes: the same array until the size changes."""
        if self.guard.size != size:
            self.guard = np.zeros(size, np.uint8)
        return self.guard

    def write(self, fd: int, pieces: list[memoryview]) -> int:
        guard = self.guard
        if any(getattr(p, "obj", None) is guard for p in pieces):
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
        self.durable = segments.producer(cfg, spec.rank, "durable")
        self.ops = _GuardedOps()
        self.store = PageStore(
            cfg.store_dir, spec.rank, lease_seconds=cfg.lease_seconds, fileops=self.ops,
            hook=lifecycle.checkpoint,
        )
        # Per capture process (pid, start time): the latest hand-over a popped record
        # covers. Every slot that process handed over no later than that may be read.
        self._covered: dict[tuple[int, float], float] = {}
        # Capture takes a FREE slot only on its record (which orders commit's reads of the
        # slot before capture's writes), so none may be lost; the repeats also tell a
        # capture that restarted about the slots its predecessor had been told of.
        self.freed_records = SlotAnnouncer(self.freed, self.arena, FREE)

    def close(self) -> None:
        self.store.close()
        self.filled.close()
        self.freed.detach()
        self.durable.detach()
        self.arena.close()

    def run(self) -> None:
        # Recovery before READY: slots whose capture died go first. Records behind them in
        # the ring are newer publications, maybe later turns of the same sequence, which a
        # redo after them would replace with the older turn.
        self._commit_readable()
        self.life.serve(self._step, POLL_S)
        # Drain. The supervisor stops capture before commit, so every record capture
        # pushed is in the ring by now; unless the signal came to both at once (Ctrl-C,
        # or a service manager signalling every process of the unit): then capture may
        # still hand slots over, whose publications would be lost with the arena, so
        # commit takes records until capture is gone. The beats are progress: the
        # supervisor kills only a drain that stalls.
        while True:
            capture = self.life.peer_running(Role.CAPTURE)
            if not self._pop(POLL_S if capture else 0) and not capture:
                break
            self.life.beat()
        self._commit_readable()

    def _step(self, timeout: float) -> None:
        self._pop(timeout)
        self._commit_readable()
        self.freed_records.flush()


    def _pop(self, timeout: float) -> bool:
        """Take the records in the ring and commit what they cover; False if there were
        none."""
        try:
            batch = self.filled.pop_batch(_POP, timeout=timeout)
        except (RingEmpty, RingClosed, SignalError):
            return False
        for slot, _, generation in batch.tolist():
            lifecycle.checkpoint("commit.popped")
            if not 0 <= slot < self.arena.slots:
                self.life.drop("slot", f"filled record for slot {slot}")
                continue
            # A stale record (the slot was committed and taken again since) is skipped.
            st = self.arena.held(slot, OWNER_COMMIT)
            if st is not None and int(st["generation"]) == generation:
                holder = (int(st["pid"]), float(st["pid_start"]))
                self._covered[holder] = max(self._covered.get(holder, 0.0), float(st["since"]))
                self._commit_readable()
        return True

    def _commit_readable(self) -> None:
        """Commit every held slot that may be read (see the module notes), in hand-over
        order: two turns of a sequence share a root, and the later turn must come last.
        (``since`` is CLOCK_MONOTONIC, one clock for every process of the host.)"""
        readable = []
        for i in range(self.arena.slots):
            # Read where no record covers it: the since and pid of the hand-over that made
            # commit the holder, never of the one before (SlotArena.held).
            st = self.arena.held(i, OWNER_COMMIT)
            if st is None:
                continue
            since = float(st["since"])
            covered = self._covered.get((int(st["pid"]), float(st["pid_start"])))
            if (covered is not None and since <= covered) or writer_dead(st):
                readable.append((since, i))
        for _, slot in sorted(readable):
            self._commit_slot(slot)
        self._forget_dead_captures()

    def _forget_dead_captures(self) -> None:
        for pid, start in list(self._covered):
            if not creator_alive(pid, start):
                del self._covered[(pid, start)]

    def _commit_slot(self, slot: int) -> None:
        buf = self.arena.slot_array(slot)
        pub_id, status = None, DurableStatus.BAD_SLOT
        part_only = False  # a part before the last: its publication is reported with that
        started = time.perf_counter()
        try:
            contents = slotfmt.read(buf)
            pub_id = contents.pub_id
            status = DurableStatus.COMMIT_FAILED
            guard = self.ops.ensure(contents.page_bytes)
            keys = join_keys(contents.entries["key_hi"], contents.entries["key_lo"])
            pages = [
                PageData(key, guard if copied < 0 else contents.pieces(buf, copied))
                for key, copied in zip(keys, contents.entries["copied"].tolist(), strict=True)
            ]
            root_id = join_key(*contents.root)
            t0 = time.perf_counter()
            if not contents.last:
                part_only = True
                result = self.store.stage(Root(root_id, pages))
                log.debug("staged part %d of %d of %s in %.3fs: %s", contents.part + 1,
                          contents.parts, root_id, time.perf_counter() - t0, result)
            else:
                # Ends capture's read lease of the pages it did not copy (named by the
                # publication) in the commit's transaction.
                result = self.store.commit(Root(root_id, pages), release=pub_id)
                status = DurableStatus.DURABLE
                self.life.processed += 1
                self.life.roots_superseded += result.roots_superseded
                log.debug("committed %s in %.3fs: %s", root_id, time.perf_counter() - t0,
                          result)
        except ValueError as exc:
            self.life.failed += 1
            log.warning("slot %d holds no readable publication: %s", slot, exc)
        except CommitFailed as exc:
            self.life.failed += 1
            if index.sync_failed(exc):
                # Not acknowledged, and nothing after it may be (IndexSyncFailed): the
                # worker stops, FATAL, its slot left for an operator's restart to redo.
                raise
            if is_disk_full(exc):
                self.life.disk_full_error(f"the commit of slot {slot}", exc)
            else:
                log.warning("slot %d not committed: %s", slot, exc)
            self.store.check_usable()
        except ENVIRONMENT_FAULTS:
            raise
        except Exception:
            self.life.failed += 1
            self.life.item_error("slot", slot)
            self.store.check_usable()
        if not part_only:
            # A publication's outcome and duration are its last part's (its root's).
            self.life.timed(time.perf_counter() - started)
            self.life.outcome(int(status))
        counters = self.store.counters
        self.life.report.update(lock_wait_s=counters.lock_wait_s,
                                lock_wait_max_s=counters.lock_wait_max_s)
        lifecycle.checkpoint("commit.committed")
        # The acknowledgement goes before the slot is freed: a commit killed between the
        # two leaves the slot held, so its successor redoes it and acknowledges again
        # (the client settles a publication once, and ignores the second). Freed first, a
        # kill between lost the acknowledgement for good.
        if pub_id is not None and not part_only:
            try:
                self.durable.try_push((pub_id, int(status), 0))
            except RingFull:
                # The engine's bookkeeping of that publication times out instead.
                log.warning("durable ring full; acknowledgement of %d dropped", pub_id)
        lifecycle.checkpoint("commit.acknowledged")
        self.arena.hand_over(slot, OWNER_COMMIT, FREE)
        lifecycle.checkpoint("commit.slot_freed")
        self.freed_records.add(slot)


def _body(life: Lifecycle) -> None:
    c = Commit(life)
    try:
        c.run()
    finally:
        c.close()


def run(spec: WorkerSpec) -> None:
    lifecycle.main(spec, _body)
