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
from collections.abc import Callable
from dataclasses import dataclass

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
from sparkcache.store import (
    CommitFailed,
    CommitResult,
    PageData,
    PageStore,
    Publication,
    Root,
    index,
)
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
        self.slot_bytes = cfg.capture_slot_bytes
        self.ops = _GuardedOps()
        self.store = PageStore(
            cfg.store_dir, spec.rank, lease_seconds=cfg.lease_seconds, fileops=self.ops,
            hook=lifecycle.checkpoint, checkpoint_thread=True,
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
        if not self._take_records(timeout):
            return False
        self._commit_readable()
        return True

    def _take_records(self, timeout: float) -> bool:
        """Take the records in the ring: the slots they cover may be read. False if there
        were none."""
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
        return True

    def _commit_readable(self) -> None:
        """Commit every held slot that may be read (see the module notes), in hand-over
        order: two turns of a sequence share a root, and the later turn must come last.

        They are committed as one batch (``PageStore.commit_batch``), which slots that
        become readable while its pages are written join: one sync and one transaction
        where each publication had its own. A batch stops growing at one slot's bytes or
        all slots but one, so capture always has a slot to fill while it commits."""
        readable = self._readable()
        taken = [self._read_slot(slot) for _, slot in readable]
        batch = [t for t in taken if t.publication is not None]
        last = readable[-1][0] if readable else 0.0

        def more() -> list[Publication]:
            nonlocal last
            room = self.arena.slots - 1 - len(taken)
            if room <= 0 or sum(t.nbytes for t in taken) >= self.slot_bytes:
                return []
            self._take_records(0)
            # Only slots handed over after the batch's: hand-over order is commit order.
            later = [(since, slot) for since, slot in self._readable() if since > last][:room]
            if later:
                last = later[-1][0]
            new = [self._read_slot(slot) for _, slot in later]
            taken.extend(new)
            new = [t for t in new if t.publication is not None]
            batch.extend(new)
            return [t.publication for t in new]

        if batch:
            self._commit_batch(batch, more)
        for t in taken:
            self._finish(t)
        self._forget_dead_captures()

    def _readable(self) -> list[tuple[float, int]]:
        """(since, slot) of the slots commit holds and may read, in hand-over order.
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
        return sorted(readable)

    def _forget_dead_captures(self) -> None:
        for pid, start in list(self._covered):
            if not creator_alive(pid, start):
                del self._covered[(pid, start)]

    def _read_slot(self, slot: int) -> _Taken:
        """What ``slot`` holds: a publication (a root, or a part of one to stage), or an
        unreadable slot, reported as such."""
        started = time.perf_counter()
        buf = self.arena.slot_array(slot)
        pub_id = None
        try:
            contents = slotfmt.read(buf)
            pub_id = contents.pub_id
            guard = self.ops.ensure(contents.page_bytes)
            keys = join_keys(contents.entries["key_hi"], contents.entries["key_lo"])
            pages = [
                PageData(key, guard if copied < 0 else contents.pieces(buf, copied))
                for key, copied in zip(keys, contents.entries["copied"].tolist(), strict=True)
            ]
            root = Root(join_key(*contents.root), pages)
            nbytes = int((contents.entries["copied"] >= 0).sum()) * contents.page_bytes
        except ValueError as exc:
            self.life.failed += 1
            log.warning("slot %d holds no readable publication: %s", slot, exc)
            return _Taken(slot, started, pub_id)
        # The last part ends capture's read lease of the pages it did not copy (named by
        # the publication) in the commit's transaction; an earlier part only stages.
        publication = (Publication(root, release=contents.pub_id) if contents.last
                       else Publication(root, place=False))
        return _Taken(slot, started, pub_id, publication, DurableStatus.COMMIT_FAILED, nbytes)

    def _commit_batch(self, batch: list[_Taken], more: Callable[[], list[Publication]]
                      ) -> None:
        """Commit the publications of ``batch`` as one, with those ``more`` adds to it
        (``PageStore.commit_batch``; ``batch`` grows with them). If that fails, each is
        committed alone, so each gets its own outcome."""
        try:
            results = self.store.commit_batch([t.publication for t in batch], more)
        except CommitFailed as exc:
            if index.sync_failed(exc) or len(batch) == 1:
                self._failed(batch[0], exc)
                return
            log.info("%d publications not committed as one (%s): one by one", len(batch), exc)
        except ENVIRONMENT_FAULTS:
            raise
        except Exception:
            if len(batch) == 1:
                self._errored(batch[0])
                return
            log.exception("%d publications not committed as one: one by one", len(batch))
        else:
            for t, result in zip(batch, results, strict=True):
                self._committed(t, result)
            return
        self.store.check_usable()
        for t in batch:
            self._commit_one(t)

    def _commit_one(self, t: _Taken) -> None:
        try:
            self._committed(t, self.store.commit_batch([t.publication])[0])
        except CommitFailed as exc:
            self._failed(t, exc)
        except ENVIRONMENT_FAULTS:
            raise
        except Exception:
            self._errored(t)

    def _errored(self, t: _Taken) -> None:
        """A commit of ``t`` that raised what no commit should: counted and logged."""
        self.life.failed += 1
        self.life.item_error("slot", t.slot)
        self.store.check_usable()

    def _failed(self, t: _Taken, exc: CommitFailed) -> None:
        self.life.failed += 1
        if index.sync_failed(exc):
            # Not acknowledged, and nothing after it may be (IndexSyncFailed): the worker
            # stops, FATAL, its slots left for an operator's restart to redo.
            raise exc
        if is_disk_full(exc):
            self.life.disk_full_error(f"the commit of slot {t.slot}", exc)
        else:
            log.warning("slot %d not committed: %s", t.slot, exc)
        self.store.check_usable()

    def _committed(self, t: _Taken, result: CommitResult) -> None:
        if t.publication.place:
            t.status = DurableStatus.DURABLE
            self.life.processed += 1
            self.life.roots_superseded += result.roots_superseded
        log.debug("%s %s in %.3fs: %s", "committed" if t.publication.place else "staged",
                  result.root_id, time.perf_counter() - t.started, result)

    def _finish(self, t: _Taken) -> None:
        """Report ``t``'s outcome, acknowledge it and free its slot."""
        part_only = t.publication is not None and not t.publication.place
        if not part_only:
            # A publication's outcome and duration are its last part's (its root's).
            self.life.timed(time.perf_counter() - t.started)
            self.life.outcome(int(t.status))
        counters = self.store.counters
        self.life.report.update(lock_wait_s=counters.lock_wait_s,
                                lock_wait_max_s=counters.lock_wait_max_s)
        lifecycle.checkpoint("commit.committed")
        # The acknowledgement goes before the slot is freed: a commit killed between the
        # two leaves the slot held, so its successor redoes it and acknowledges again
        # (the client settles a publication once, and ignores the second). Freed first, a
        # kill between lost the acknowledgement for good.
        if t.pub_id is not None and not part_only:
            try:
                self.durable.try_push((t.pub_id, int(t.status), 0))
            except RingFull:
                # The engine's bookkeeping of that publication times out instead.
                log.warning("durable ring full; acknowledgement of %d dropped", t.pub_id)
        lifecycle.checkpoint("commit.acknowledged")
        self.arena.hand_over(t.slot, OWNER_COMMIT, FREE)
        lifecycle.checkpoint("commit.slot_freed")
        self.freed_records.add(t.slot)


@dataclass(eq=False)
class _Taken:
    """A slot commit read: its publication (None: unreadable) and how it ended."""

    slot: int
    started: float
    pub_id: int | None = None
    publication: Publication | None = None
    status: DurableStatus = DurableStatus.BAD_SLOT
    nbytes: int = 0  # page bytes the slot holds (capture copied)


def _body(life: Lifecycle) -> None:
    c = Commit(life)
    try:
        c.run()
    finally:
        c.close()


def run(spec: WorkerSpec) -> None:
    lifecycle.main(spec, _body)
