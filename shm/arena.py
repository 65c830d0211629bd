"""Slot arena: N fixed-size byte slots in one segment, each with an owner.

Payload layout, ARENA_LAYOUT_VERSION 4:

    0      META    slots u64, slot_bytes u64, data_at u64 (128-byte line)
    128    STATE   one SLOT_STATE record (40 bytes) per slot: owner; pid of the process
                   that made the last hand-over (0 before the first): the writer of the
                   slot's bytes when it holds a filled publication; generation; since
                   (CLOCK_MONOTONIC of the last hand-over: one clock for every process of
                   the host, so it orders hand-overs); used bytes; pid_start (that
                   process's start, ``process_start``, so a reused pid is not taken for it)
    D      DATA    slots x slot_bytes, D page-aligned (4096) so slots suit O_DIRECT/DMA

Ownership passes from one process to the next along a ring: whoever holds a slot sets
its new owner *before* pushing the slot's id, and the receiver reads the slot only after
popping that id, so the ring's semaphore orders the slot's bytes and its state. The
state is therefore written by one process at a time and needs no lock; whoever needs
counts by owner derives them from it when read (they are never stored twice).

A slot's state is also read where no record covers it (commit finding the slots an
earlier record covers, or whose writer died; a new capture finding free slots). On arm64
another core may see a hand-over's stores in any order, so such a reader could see the
new owner beside the pid, generation or since of the hand-over before, and take a slot
no record covers. So ``hand_over`` stores the owner last behind a ``fence``, and ``held``
reads it first, then fences, then the rest: a reader that sees an owner sees the fields
of that hand-over (or a later one).

A holder that dies leaves its slots owned by its role, not by a pid: the next process of
that role recovers them (a new capture frees the slots capture held, a new commit commits
the slots commit holds; see docs/pipeline.md). Nothing else, the supervisor included,
changes a slot's owner.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
from sparkcache.shm.segment import Segment, SegmentSpec, creator_alive, process_start

ARENA_LAYOUT_VERSION = 4  # 1 had "since" in wall-clock time; 2 no pid_start; 3 pid_start
# in wall-clock time (psutil create_time)
ARENA_KIND = "arena"
FREE = 0  # owner value of a slot nobody holds

SLOT_STATE = np.dtype(
    [("owner", "<u4"), ("pid", "<u4"), ("generation", "<u8"), ("since", "<f8"), ("used", "<u8"),
     ("pid_start", "<f8")]
)
_META = np.dtype([("slots", "<u8"), ("slot_bytes", "<u8"), ("data_at", "<u8")])
_STATE_AT = 128
_PAGE = 4096


class SlotOwnershipError(RuntimeError):
    """A slot was handed over by a process that did not hold it."""


_START: tuple[int, float] = (0, 0.0)  # (pid, its start time), cached per process
_FENCES = threading.local()


def fence() -> None:
    """A full memory barrier for the calling thread, which Python has no statement for:
    the release and re-acquisition of a lock this thread holds. CPython's lock is a POSIX
    semaphore on Linux (glibc, as its mutex otherwise): the post (a release) orders every
    access before it before itself, the wait (an acquire) that follows it on the same
    word orders every access after it after itself."""
    lock = getattr(_FENCES, "lock", None)
    if lock is None:
        lock = _FENCES.lock = threading.Lock()
        lock.acquire()
    lock.release()
    lock.acquire()


def _own_start() -> float:
    global _START
    if _START[0] != os.getpid():
        _START = (os.getpid(), process_start(os.getpid()))
    return _START[1]


def _spec() -> SegmentSpec:
    return SegmentSpec(ARENA_KIND, ARENA_LAYOUT_VERSION)


class SlotArena:
    def __init__(self, seg: Segment) -> None:
        self._seg = seg
        self.name = seg.name
        meta = seg.array(_META, 0, 1)[0]
        self.slots = int(meta["slots"])
        self.slot_bytes = int(meta["slot_bytes"])
        self._data_at = int(meta["data_at"])
        self.state = seg.array(SLOT_STATE, _STATE_AT, self.slots)

    @classmethod
    def create(cls, name: str, slots: int, slot_bytes: int, reserve: bool = True) -> SlotArena:
        """``reserve``: allocate the slots now (``Segment.create``); False only where
        nothing will write them (no capture), since tmpfs allocates nothing untouched."""
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"arena of {slots} slots of {slot_bytes} bytes: expected >= 1 each")
        data_at = (_STATE_AT + SLOT_STATE.itemsize * slots + _PAGE - 1) // _PAGE * _PAGE
        seg = Segment.create(name, _spec(), data_at + slots * slot_bytes, reserve=reserve)
        meta = seg.array(_META, 0, 1)
        meta[0] = (slots, slot_bytes, data_at)
        del meta
        return cls(seg)

    @classmethod
    def attach(cls, name: str) -> SlotArena:
        return cls(Segment.attach(name, _spec()))

    def slot_array(self, index: int, dtype: np.dtype | str = np.uint8) -> np.ndarray:
        self._check_index(index)
        count = self.slot_bytes // np.dtype(dtype).itemsize
        return self._seg.array(dtype, self._data_at + index * self.slot_bytes, count)

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.slots:
            raise IndexError(f"slot {index}: expected 0-{self.slots - 1}")

    def hand_over(self, index: int, from_owner: int, to_owner: int, used: int = 0) -> None:
        """Move slot ``index`` from ``from_owner`` to ``to_owner``; the caller must be the
        current holder. Taking a free slot bumps its generation."""
        self._check_index(index)
        st = self.state[index]
        if int(st["owner"]) != from_owner:
            raise SlotOwnershipError(
                f"slot {index} of {self.name} is owned by {int(st['owner'])}, not {from_owner}"
            )
        # The writer first: one killed before its generation store leaves the slot's
        # old generation under its own (dead) pid, which its successor may take back.
        st["pid"] = os.getpid()
        st["pid_start"] = _own_start()
        if from_owner == FREE:
            st["generation"] += 1
        st["used"] = used if to_owner != FREE else 0
        st["since"] = time.monotonic()
        fence()  # the owner last (see the module notes)
        st["owner"] = to_owner

    def held(self, index: int, owner: int) -> np.void | None:
        """Slot ``index``'s state if ``owner`` holds it, else None, read where no record
        covers it: the owner first, then (after a fence) a copy of the rest, which is
        then that of the hand-over that made ``owner`` the holder, or of a later one."""
        st = self.state[index]
        if int(st["owner"]) != owner:
            return None
        fence()
        return st.copy()

    def held_by(self, owner: int) -> list[tuple[int, np.void]]:
        """The slots ``owner`` holds, each with its state as ``held`` reads it."""
        return [(i, st) for i in range(self.slots) if (st := self.held(i, owner)) is not None]

    def close(self) -> None:
        del self.state
        self._seg.close()

    def __enter__(self) -> SlotArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def writer_dead(state: np.void) -> bool:
    """True if the process that made the hand-over of a slot's ``state`` (as
    ``SlotArena.held`` read it) is known dead (its pid gone, or reused by a process
    started at another time), or there was none (the arena's creator wrote the slot
    before any other process attached). Its writes to the slot are then complete: a
    reader may use them without a covering semaphore operation."""
    pid = int(state["pid"])
    return pid == 0 or not creator_alive(pid, float(state["pid_start"]))
