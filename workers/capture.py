"""The capture worker of one rank: publish ring -> capture slot -> commit.

Per publication: validate every field of its records (a malformed one is dropped and
counted by reason, never captured), check its deadline and registration, bounds-check
every block id against the registered geometry, lease the leading pages the store
already holds (so they are still there when commit comes), copy only the rest (the page
delta) into a free slot, re-check the deadline (a copy that ended late may have raced the
engine reusing the blocks: dropped), hand the slot to commit and tell the engine its
blocks are free. Statuses (``protocol.CaptureStatus``) travel on the completion ring.

A delta larger than a slot goes in parts, a slot each, in page order (``slotfmt.plan_parts``):
capture fills the next slot while commit writes the one before, and commit stages every
part but the last, which publishes the root. Pages an earlier attempt staged are held, not
copied again, so a publication cut short by a kill or its deadline is finished by the
next one.

Hand-overs are announced to commit on the ``filled`` ring in the order they were made,
and again after ``REMIND_AFTER_S`` for a slot commit still holds (``workers.announce``):
a commit that died after popping a record finds the slot through the repeat
(workers/commit.py says why it needs one).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
from posix_ipc import SignalError
from sparkcache.shm import FREE, RingClosed, RingEmpty, RingFull
from sparkcache.shm.arena import writer_dead
from sparkcache.shm.layouts import join_keys
from sparkcache.shm.segment import process_gone
from sparkcache.workers import lifecycle, slotfmt
from sparkcache.workers.announce import SlotAnnouncer
from sparkcache.workers.batches import split_batches
from sparkcache.workers.lifecycle import ENVIRONMENT_FAULTS, Lifecycle, WorkerSpec
from sparkcache.workers.prefault import Prefaulter

from sparkcache import kvmem, registry, segments
from sparkcache.protocol import CaptureStatus, release_seconds
from sparkcache.segments import OWNER_CAPTURE, OWNER_COMMIT
from sparkcache.store import PageStore
from sparkcache.store.index import OutcomeUnknown

log = logging.getLogger(__name__)

POLL_S = 0.2
PUBLISH_CAPACITY = segments.RINGS["publish"][1]  # also the most pages of one publication
# Clocks of two processes read at slightly different moments: a deadline this much past
# the release timeout is still taken as the client's.
_DEADLINE_SLACK_S = 1.0
# How often an idle capture checks that the engine of its open registration lives.
OWNER_CHECK_S = 1.0
_UNIFORM = ("pub_id", "root_hi", "root_lo", "reg_gen", "npages", "deadline")


def split_publications(batch: np.ndarray, capacity: int,
                       ) -> list[tuple[np.ndarray, str | None]]:
    """The publications in a popped batch, each with the reason it is malformed or None
    (``workers.batches.split_batches``); a deadline must be finite (how far ahead it may
    be depends on the publication's bytes: ``Capture._capture`` checks that once it has
    the registration)."""
    def deadline(recs: np.ndarray) -> str | None:
        return None if np.isfinite(recs["deadline"]).all() else "deadline"

    return split_batches(batch, capacity, _UNIFORM, deadline)


@dataclass
class _Registered:
    reg_gen: int
    opened: kvmem.OpenedTensors
    views: kvmem.BlockViews
    owner: tuple[float, float] | None  # the registering engine's pid and start time
    ipc_ref_files: list[str]  # torch's, for CUDA tensors (registry.ipc_ref_files)


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
        # Its only writes are leases, which a crash may lose: no fsync at each.
        self.store = PageStore(cfg.store_dir, spec.rank, lease_seconds=cfg.lease_seconds,
                               durable=False, checkpoint_thread=True)
        self.reg: _Registered | None = None
        self._owner_check_at = 0.0  # when the registering engine is next checked alive
        self.filled_records = SlotAnnouncer(self.filled, self.arena, OWNER_COMMIT)
        # Slots a dead predecessor was filling are ours to free: nobody else takes them.
        for i in range(self.arena.slots):
            if int(self.arena.state[i]["owner"]) == OWNER_CAPTURE:
                self.arena.hand_over(i, OWNER_CAPTURE, FREE)
        # Other FREE slots come with their freed record (commit repeats it while the slot
        # stays FREE): reading them before that could overwrite bytes commit still reads.
        mine = os.getpid()
        self.free = {i for i, st in self.arena.held_by(FREE)
                     if writer_dead(st) or int(st["pid"]) == mine}
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
        self.filled_records.flush()
        self._take_freed(0)  # commit repeats its records: keep the ring from filling
        try:
            batch = self.publish.pop_batch(PUBLISH_CAPACITY, timeout=timeout)
        except (RingEmpty, RingClosed, SignalError):
            self._drop_dead_registration()
            return False
        for recs, malformed in split_publications(batch, PUBLISH_CAPACITY):
            pub_id = int(recs["pub_id"][0])
            copied = 0
            if malformed is not None:
                self.life.drop(malformed, f"publication {pub_id} ({len(recs)} records)")
                status = CaptureStatus.MALFORMED
            else:
                t0 = time.perf_counter()
                try:
                    status, copied = self._capture(recs)
                except ENVIRONMENT_FAULTS:
                    raise
                except Exception:
                    self.life.item_error("publication", pub_id)
                    status = CaptureStatus.FAILED
                self.life.timed(time.perf_counter() - t0)
            self.life.outcome(int(status))
            if status != CaptureStatus.CAPTURED:
                self.life.failed += 1
            try:
                self.completion.try_push((pub_id, int(status), copied))
            except RingFull:
                log.warning("completion ring full; the client releases by deadline")
        return True

    # ------------------------------------------------------------------ one publication

    def _release_s(self, reg: _Registered, npages: int) -> float:
        """The longest the engine lends ``npages`` pages' blocks (``release_seconds``),
        queued behind the most pages it may count ahead of them."""
        return release_seconds(self.cfg.release_timeout_seconds,
                               npages * reg.views.page_bytes,
                               self.arena.slots * self.arena.slot_bytes,
                               segments.PUBLISH_AHEAD_MAX_PAGES * reg.views.page_bytes)

    def _registration(self, reg_gen: int) -> _Registered | None:
        if self.reg is not None and self.reg.reg_gen == reg_gen:
            return self.reg
        desc = kvmem.read_registry(self.cfg.store_dir, self.rank)
        if desc is None or desc.get("reg_gen") != reg_gen:
            return None
        if self.reg is not None:
            self.reg.opened.close()
            self.reg = None
        try:
            opened = kvmem.open_tensors(desc)
        except Exception:
            # The engine's registration, not capture's environment: this publication
            # fails, and the next registration may be fine.
            self.life.item_error("registration", reg_gen)
            return None
        try:
            views = kvmem.BlockViews(opened.tensors, int(desc["block_dim"]))
        except Exception:
            opened.close()
            self.life.item_error("registration", reg_gen)
            return None
        self.reg = _Registered(reg_gen, opened, views, registry.registration_owner(desc),
                               registry.ipc_ref_files(desc))
        return self.reg

    def _drop_dead_registration(self) -> None:
        """Idle, at most once per OWNER_CHECK_S: close the registration whose engine is
        gone. Its KV segment, unlinked, lives on only while mapped here, and a restarted
        engine adopts a new one as large into /dev/shm."""
        now = time.monotonic()
        if self.reg is None or self.reg.owner is None or now < self._owner_check_at:
            return
        self._owner_check_at = now + OWNER_CHECK_S
        if process_gone(*self.reg.owner):
            log.info("registration %d: its engine is gone; its KV unmapped", self.reg.reg_gen)
            self.reg.opened.close()
            registry.unlink_ipc_files(self.reg.ipc_ref_files, int(self.reg.owner[0]))
            self.reg = None
            # And unlinked: an engine SIGKILLed never unlinked it, and unmapped alone it
            # held its /dev/shm (the whole KV cache) until the next engine's start.
            kvmem.unlink_dead_engines(self.cfg.instance, self.rank)

    def _take_freed(self, timeout: float) -> None:
        """Move the slots of the freed records in the ring (waiting up to ``timeout`` for
        one) into the free set."""
        try:
            records = self.freed.pop_batch(256, timeout=timeout).tolist()
        except (RingEmpty, RingClosed, SignalError):
            if timeout:
                self.life.beat()
            return
        for slot, _, generation in records:
            if not 0 <= slot < self.arena.slots:
                self.life.drop("slot", f"freed record for slot {slot}")
                continue
            # A record may be stale (repeated, or from before this worker started, the
            # slot taken since): only the generation commit freed is free.
            st = self.arena.state[slot]
            if int(st["owner"]) == FREE and int(st["generation"]) == generation:
                self.free.add(slot)

    def _take_slot(self, deadline: float) -> int | None:
        timeout = 0.0
        while True:
            # Hand-overs the full filled ring refused go out meanwhile: commit frees only
            # the slots it was told of.
            self.filled_records.flush()
            self._take_freed(timeout)
            if not self.free:
                # A slot can be FREE without a record when commit died between handing it
                # back and pushing the record: its writer is dead, so it may be taken.
                self.free.update(i for i, st in self.arena.held_by(FREE) if writer_dead(st))
            if self.free:
                return self.free.pop()
            left = deadline - time.monotonic()
            if left <= 0 or self.life.stop:
                return None
            timeout = min(left, POLL_S)

    def _capture(self, recs: np.ndarray) -> tuple[CaptureStatus, int]:
        deadline = float(recs["deadline"][0])
        if time.monotonic() >= deadline:
            return CaptureStatus.EXPIRED, 0
        reg = self._registration(int(recs["reg_gen"][0]))
        if reg is None:
            return CaptureStatus.UNREGISTERED, 0
        n = len(recs)
        if deadline > time.monotonic() + self._release_s(reg, n) + _DEADLINE_SLACK_S:
            self.life.drop("deadline", f"publication {int(recs['pub_id'][0])} of {n} pages")
            return CaptureStatus.MALFORMED, 0
        blocks = recs["block_id"]
        if (blocks < 0).any() or (blocks >= reg.views.num_blocks).any():
            self.life.drop("block", f"publication with block ids outside "
                           f"0-{reg.views.num_blocks - 1}")
            return CaptureStatus.BAD_BLOCK, 0
        keys = join_keys(recs["key_hi"], recs["key_lo"])
        # Leased, not only looked up: under pressure the root holding these pages could
        # otherwise be evicted before commit, which then has no bytes for them. The
        # lease is named by the publication, whose commit ends it. Pages an earlier
        # attempt staged (a kill or a deadline in the middle of its parts) are held
        # likewise and not copied again.
        try:
            stored = self.store.lease_prefix(keys, self.cfg.lookup_lease_seconds,
                                             int(recs["pub_id"][0]))
            staged = self.store.hold_staged(keys[stored:], self.store.stage_hold_s)
        except OutcomeUnknown:
            # The lease's COMMIT failed (the disk full for a moment, say): a StoreError,
            # which would end capture for good, while only this publication fails, unless
            # the store itself is gone.
            self.store.check_usable()
            self.life.item_error("lease")
            return CaptureStatus.FAILED, 0
        delta = [i for i in range(stored, n) if keys[i] not in staged]
        parts = slotfmt.plan_parts(n, delta, self.arena.slot_bytes, reg.views.run_bytes)
        if parts is None:
            return CaptureStatus.TOO_LARGE, 0
        for part, pages in enumerate(parts):
            status = self._capture_part(recs, reg, pages, part, len(parts), deadline)
            if status != CaptureStatus.CAPTURED:
                # Parts handed over are staged: the next attempt copies only the rest.
                return status, 0
        return CaptureStatus.CAPTURED, len(delta)

    def _capture_part(self, recs: np.ndarray, reg: _Registered, pages: list[int], part: int,
                      parts: int, deadline: float) -> CaptureStatus:
        """Copy ``pages`` (indices into ``recs``) into a slot and hand it to commit: part
        ``part`` of ``parts``."""
        slot = self._take_slot(deadline)
        if slot is None:
            return CaptureStatus.NO_SLOT
        self.arena.hand_over(slot, FREE, OWNER_CAPTURE)
        lifecycle.checkpoint("capture.slot_taken")
        try:
            status = self._fill(slot, recs, reg, pages, part, parts, deadline)
        except ENVIRONMENT_FAULTS:
            raise
        except Exception:
            self.life.item_error("the copy of publication", int(recs["pub_id"][0]))
            status = CaptureStatus.FAILED
        if status != CaptureStatus.CAPTURED:
            self.arena.hand_over(slot, OWNER_CAPTURE, FREE)
            self.free.add(slot)
        return status

    def _fill(self, slot: int, recs: np.ndarray, reg: _Registered, pages: list[int],
              part: int, parts: int, deadline: float) -> CaptureStatus:
        runs = reg.views.run_bytes
        last = part == parts - 1
        # Every part but the last carries only its own pages; the last, every page's entry.
        entries = recs if last else recs[pages]
        copied = np.full(len(entries), -1, np.int64)
        copied[pages if last else slice(None)] = np.arange(len(pages))
        buf = self.arena.slot_array(slot)
        # CPU time, not wall: on a host without spare cores the wall clock would also
        # count the time the scheduler gave the engine or commit.
        t0 = time.thread_time()
        reg.views.gather_runs(recs["block_id"][pages].tolist(),
                              slotfmt.data(buf, len(entries), len(pages), runs))
        self.life.copy_seconds += time.thread_time() - t0
        self.life.copy_bytes += len(pages) * reg.views.page_bytes
        if time.monotonic() >= deadline:
            return CaptureStatus.EXPIRED  # the engine may have reused the blocks meanwhile
        root = (int(recs["root_hi"][0]), int(recs["root_lo"][0]))
        slotfmt.write_header(buf, int(recs["pub_id"][0]), root, entries, copied, runs,
                             part, parts)
        used = slotfmt.needed(len(entries), len(pages), runs)
        lifecycle.checkpoint("capture.copied")
        self.arena.hand_over(slot, OWNER_CAPTURE, OWNER_COMMIT, used)
        lifecycle.checkpoint("capture.handed")
        self.filled_records.add(slot)
        lifecycle.checkpoint("capture.filled")
        if last:
            self.life.processed += 1
        return CaptureStatus.CAPTURED


def _body(life: Lifecycle) -> None:
    torch.set_num_threads(1)  # one pinned core: no thread pool fighting the engine
    cap = Capture(life)
    try:
        cap.run()
    finally:
        cap.close()


def run(spec: WorkerSpec) -> None:
    lifecycle.main(spec, _body)
