"""Single-producer single-consumer ring of fixed-size records in shared memory.

Byte layout of the payload (after the segment header), RING_LAYOUT_VERSION 1, all u64
little-endian unless noted; each group starts on its own 128-byte line so the producer
and the consumer never write the same cache line:

    0    META      capacity, itemsize, record_version, record_name (32 bytes)
    128  PRODUCER  pushed (batches posted), freed (space posts taken), closed, pid
    256  CONSUMER  tail (next record), batch (next batch), acquired (0/1), taken, pid
    384  TABLE     capacity entries of (seq, start, count, 0): one per pushed batch
    R    RECORDS   capacity records, R = 384 + 32 * capacity rounded up to 128

Memory ordering. Python cannot issue fences, and on arm64 a plain store may become
visible to another core before stores that preceded it. So no index is ever trusted
because it *looks* advanced: every cross-process hand-over goes through a POSIX
semaphore, whose post is a release and whose successful wait/trywait is an acquire.

* ``data`` semaphore, posted once per pushed batch, after the producer wrote the batch's
  records and its TABLE entry. The consumer counts its successful waits: after the m-th
  one, at least m posts precede it in the semaphore's modification order, and because
  every operation on a semaphore is a read-modify-write, its acquire synchronises with
  all of them. So TABLE entries 0..m-1 and their records are visible, and the consumer
  reads only those: never the producer's counters.
* ``space`` semaphore, posted once per batch the consumer has finished reading. The
  producer counts its successful waits the same way and reuses the records of exactly
  that many batches, oldest first, reading only TABLE entries it wrote itself.

A spinning consumer therefore spins on the semaphore, never on an index: it reads the
semaphore's value as a hint (a failing ``trywait`` costs ~1 us in its exception) and
reads records only after a successful ``trywait``. x86-64's stronger ordering is not
what makes this correct.

Batches are the unit of hand-over: space returns to the producer batch by batch, so a
batch the consumer has half read still occupies its records.

Crash windows (SIGKILL of an end; the other end keeps going and a new end re-attaches
from the counters persisted here):
* consumer killed between successful waits and recording them: the new consumer sees
  that the previous one died attached (an idle consumer also checks every 100 ms),
  counts posts made (``pushed``, +2 once closed) against posts taken (its recorded
  ``taken`` plus the semaphore's value), and takes the unrecorded batches as its own
  (their space was never handed back, so their records are intact) after a post-and-wait
  of its own to synchronise. Without this it would run behind, and a full ring would
  deadlock: the producer waiting for space, the consumer for a post.
* consumer killed after recording finished batches but before posting their space: the
  producer never gets those records back (capacity shrinks). Posting again on recovery
  could hand back space still being read, so the ring errs on the safe side.
* records the consumer copied out (``pop`` copies up to ``prefetch`` at once) but had
  not returned or processed are gone: delivery is at most once.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import time

import numpy as np
import posix_ipc
import psutil

from shm.records import RecordLayout
from shm.segment import PAYLOAD_OFFSET, Segment, SegmentError, SegmentSpec

log = logging.getLogger(__name__)

RING_LAYOUT_VERSION = 1
RING_KIND = "ring"

_LINE = 128
_META = struct.Struct("<QQQ32s")
_U64 = struct.Struct("<Q")
_CONSUMER = struct.Struct("<QQQQ")  # tail, batch, acquired, taken
_ENTRY = struct.Struct("<QQQQ")
_META_AT = 0
_PRODUCER_AT = _LINE  # pushed, freed, closed, pid
_CONSUMER_AT = 2 * _LINE  # tail, batch, acquired, taken (data posts acquired), pid
_PRODUCER_PID = _PRODUCER_AT + 24
_PRODUCER_CLOSED = _PRODUCER_AT + 16
_CONSUMER_PID = _CONSUMER_AT + 32
_TABLE_AT = 3 * _LINE
_NO_SEQ = 2**64 - 1

# Default bounded spin before sleeping: long enough to catch a busy producer's next post
# (round trips stay ~microseconds), short enough that an idle consumer costs nothing.
DEFAULT_SPIN_S = 50e-6
# Records a single pop may copy out at once when the ring holds a backlog.
DEFAULT_PREFETCH = 64
# How often a consumer blocked on an empty ring looks for posts it took but never
# recorded (see Consumer._adopt_unrecorded_posts).
_IDLE_CHECK_S = 0.1


class RingFull(queue.Full):
    """No space for the records; nothing was written."""


class RingEmpty(queue.Empty):
    """No record was available (within the timeout)."""


class RingClosed(Exception):
    """The producer closed the ring and every record has been read."""


def _records_at(capacity: int) -> int:
    end = _TABLE_AT + _ENTRY.size * capacity
    return (end + _LINE - 1) // _LINE * _LINE


def _spec(layout: RecordLayout) -> SegmentSpec:
    return SegmentSpec(RING_KIND, RING_LAYOUT_VERSION, layout.fingerprint)


def _sem_names(name: str) -> tuple[str, str]:
    return name + ".data", name + ".space"


class _RingMapping:
    """What both ends and the owner share: the segment, offsets and semaphores."""

    def __init__(self, seg: Segment, layout: RecordLayout) -> None:
        self.seg = seg
        self.mm = seg.mm
        self.layout = layout
        self.name = seg.name
        self.base = PAYLOAD_OFFSET
        capacity, itemsize, version, rname = _META.unpack_from(self.mm, self.base + _META_AT)
        self.capacity = capacity
        self.itemsize = itemsize
        self.records_at = self.base + _records_at(capacity)
        self._check_records(version, rname.rstrip(b"\0").decode(errors="replace"))
        data_name, space_name = _sem_names(seg.name)
        self.data = posix_ipc.Semaphore(data_name)
        self.space = posix_ipc.Semaphore(space_name)

    def _check_records(self, version: int, rname: str) -> None:
        if (rname, version, self.itemsize) != (
            self.layout.name,
            self.layout.version,
            self.layout.itemsize,
        ):
            self.seg.close()
            raise SegmentError(
                f"ring {self.name} carries records {rname!r} v{version} of {self.itemsize} "
                f"bytes; this code reads {self.layout.name!r} v{self.layout.version} of "
                f"{self.layout.itemsize} bytes"
            )

    def entry(self, k: int) -> tuple[int, int, int, int]:
        at = self.base + _TABLE_AT + _ENTRY.size * (k % self.capacity)
        return _ENTRY.unpack_from(self.mm, at)

    def u64(self, at: int) -> int:
        return _U64.unpack_from(self.mm, self.base + at)[0]

    def set_u64(self, at: int, value: int) -> None:
        _U64.pack_into(self.mm, self.base + at, value)

    def records(self, start: int, count: int) -> bytes:
        """Copy ``count`` records' bytes from ring position ``start`` (wrapping)."""
        first = min(count, self.capacity - start % self.capacity)
        at = self.records_at + (start % self.capacity) * self.itemsize
        out = self.mm[at : at + first * self.itemsize]
        if first < count:
            out += self.mm[self.records_at : self.records_at + (count - first) * self.itemsize]
        return out

    def close(self) -> None:
        self.data.close()
        self.space.close()
        self.seg.close()


class Ring:
    """The owner's handle (the supervisor creates rings) and a read-only observer's."""

    def __init__(self, mapping: _RingMapping) -> None:
        self._m = mapping
        self.name = mapping.name
        self.capacity = mapping.capacity

    @classmethod
    def create(cls, name: str, layout: RecordLayout, capacity: int) -> Ring:
        """Create the segment and its two semaphores, all mode 0600."""
        if capacity < 1:
            raise ValueError(f"ring capacity {capacity}: expected at least 1 record")
        size = _records_at(capacity) + capacity * layout.itemsize
        seg = Segment.create(name, _spec(layout), size)
        created: list[str] = []
        try:
            _META.pack_into(
                seg.mm, PAYLOAD_OFFSET + _META_AT, capacity, layout.itemsize, layout.version,
                layout.name.encode(),
            )
            table = seg.array("<u8", _TABLE_AT, 4 * capacity).reshape(capacity, 4)
            table[:, 0] = _NO_SEQ
            del table
            for sem_name in _sem_names(name):
                posix_ipc.Semaphore(sem_name, posix_ipc.O_CREX, mode=0o600, initial_value=0)
                created.append(sem_name)
            return cls(_RingMapping(seg, layout))
        except BaseException:
            for sem_name in created:
                posix_ipc.unlink_semaphore(sem_name)
            seg.close()
            raise

    @classmethod
    def attach(cls, name: str, layout: RecordLayout) -> Ring:
        """Attach as an observer (depth, ends' pids); reads only, never hands over."""
        return cls(_RingMapping(Segment.attach(name, _spec(layout)), layout))

    def depth(self) -> int:
        """Records pushed and not yet read. Read without synchronisation: a gauge, which
        may lag by a batch; never use it to decide what to read."""
        m = self._m
        pushed = m.u64(_PRODUCER_AT)
        if pushed == 0:
            return 0
        _, start, count, _ = m.entry(pushed - 1)
        return max(0, start + count - m.u64(_CONSUMER_AT))

    def pids(self) -> tuple[int, int]:
        """(producer pid, consumer pid); 0 where no end is attached."""
        return self._m.u64(_PRODUCER_PID), self._m.u64(_CONSUMER_PID)

    def close(self) -> None:
        """Unmap; the owner also unlinks the segment and its semaphores. Idempotent."""
        if self._m is None:
            return
        owner = self._m.seg.owner
        self._m.close()
        self._m = None
        if owner:
            for sem_name in _sem_names(self.name):
                try:
                    posix_ipc.unlink_semaphore(sem_name)
                except posix_ipc.ExistentialError:
                    pass

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _claim_end(m: _RingMapping, pid_at: int, role: str) -> bool:
    """Record this process as the ring's ``role``. True if the previous one died attached."""
    pid = m.u64(pid_at)
    if pid and psutil.pid_exists(pid):
        m.close()
        raise SegmentError(f"ring {m.name} already has a {role} (pid {pid}); it is single-{role}")
    m.set_u64(pid_at, os.getpid())
    return pid != 0


class Producer:
    """The writing end. Never blocks unless given a timeout."""

    def __init__(self, name: str, layout: RecordLayout) -> None:
        self._m = m = _RingMapping(Segment.attach(name, _spec(layout)), layout)
        _claim_end(m, _PRODUCER_PID, "producer")
        self.capacity = m.capacity
        self._pack = layout.packer.pack_into
        self._mm = m.mm
        self._records_at = m.records_at
        self._size = m.itemsize
        self._table_at = m.base + _TABLE_AT
        self._post = m.data.release
        self._dtype = layout.dtype
        self._closed = bool(m.u64(_PRODUCER_CLOSED))
        self._pushed = m.u64(_PRODUCER_AT)
        self._freed = m.u64(_PRODUCER_AT + 8)
        if self._pushed:
            _, start, count, _ = m.entry(self._pushed - 1)
            self._head = start + count
        else:
            self._head = 0
        self._limit = self._space_limit()

    def _space_limit(self) -> int:
        """Ring position up to which the producer may write: the start of the oldest batch
        not yet handed back, plus the capacity. Reads only TABLE entries it wrote."""
        if self._freed == self._pushed:
            return self._head + self.capacity
        return self._m.entry(self._freed)[1] + self.capacity

    def free(self) -> int:
        """Records that can be pushed without waiting for the consumer (as last known)."""
        return self._limit - self._head

    def _reserve(self, n: int, timeout: float) -> None:
        if self._closed:
            raise RingClosed(f"ring {self._m.name} is closed")
        if n > self.capacity:
            raise ValueError(f"{n} records cannot fit a ring of {self.capacity}")
        deadline = time.monotonic() + timeout
        wait = max(0.0, timeout)
        while self._freed < self._pushed:
            try:
                self._m.space.acquire(wait)
            except posix_ipc.BusyError:
                break
            self._freed += 1
            # Once enough space is back, take only what is already posted (no waiting):
            # one drain per refill instead of one acquire per push.
            if self._head + n <= self._space_limit():
                wait = 0
            else:
                wait = max(0.0, deadline - time.monotonic()) if timeout > 0 else 0
        self._m.set_u64(_PRODUCER_AT + 8, self._freed)
        self._limit = self._space_limit()
        if self._head + n > self._limit:
            raise RingFull(f"ring {self._m.name}: no space for {n} records")

    def _publish(self, n: int) -> None:
        pushed = self._pushed
        _ENTRY.pack_into(
            self._mm, self._table_at + _ENTRY.size * (pushed % self.capacity),
            pushed, self._head, n, 0,
        )
        self._head += n
        self._pushed = pushed + 1
        _U64.pack_into(self._mm, PAYLOAD_OFFSET + _PRODUCER_AT, pushed + 1)
        self._post()  # release: everything above is visible to whoever acquires it

    def try_push(self, record: tuple, timeout: float = 0.0) -> None:
        """Push one record (a tuple in field order); RingFull if there is no space."""
        if self._head >= self._limit or self._closed:
            self._reserve(1, timeout)
        self._pack(self._mm, self._records_at + (self._head % self.capacity) * self._size, *record)
        self._publish(1)

    def push_batch(self, records: np.ndarray, timeout: float = 0.0) -> None:
        """Push a structured array as one batch (all or nothing)."""
        n = len(records)
        if n == 0:
            return
        if records.dtype is not self._dtype and records.dtype != self._dtype:
            raise TypeError(f"records of dtype {records.dtype}: expected {self._dtype}")
        if self._head + n > self._limit or self._closed:
            self._reserve(n, timeout)
        if not records.flags.c_contiguous:
            records = np.ascontiguousarray(records)
        pos = self._head % self.capacity
        at = self._records_at + pos * self._size
        if pos + n <= self.capacity:
            self._mm[at : at + n * self._size] = records  # its buffer is the raw bytes
        else:
            first = self.capacity - pos
            self._mm[at : at + first * self._size] = records[:first]
            self._mm[self._records_at : self._records_at + (n - first) * self._size] = (
                records[first:]
            )
        self._publish(n)

    def close(self) -> None:
        """Tell the consumer no more records come, then detach."""
        m = self._m
        if m is None:
            return
        self._closed = True
        m.set_u64(_PRODUCER_CLOSED, 1)
        # Two posts: one wakes a consumer; the second covers a consumer that re-attached a
        # post behind (see the module notes), so its last batch is never stranded.
        m.data.release()
        m.data.release()
        self.detach()

    def detach(self) -> None:
        """Leave the ring without closing it (a new producer may attach). Idempotent."""
        if self._m is not None:
            self._m.set_u64(_PRODUCER_PID, 0)
            self._m.close()
            self._m = None


class Consumer:
    """The reading end."""

    def __init__(
        self,
        name: str,
        layout: RecordLayout,
        spin_s: float = DEFAULT_SPIN_S,
        prefetch: int = DEFAULT_PREFETCH,
    ) -> None:
        self._m = m = _RingMapping(Segment.attach(name, _spec(layout)), layout)
        died_attached = _claim_end(m, _CONSUMER_PID, "consumer")
        self.spin_s = spin_s
        self.prefetch = max(1, prefetch)
        self._buf = b""  # records pop copied out but has not returned yet
        self._buf_pos = 0
        self._dtype = layout.dtype
        self._mm = m.mm
        self._size = m.itemsize
        self._cap = m.capacity
        self._at = m.records_at
        self._table_at = m.base + _TABLE_AT
        self._sem = m.data
        self._space_post = m.space.release
        self._unpack = layout.packer.unpack_from
        self._owed = 0  # posts a dead consumer took unrecorded, adopted as ours
        self._tail, self._batch, acquired, self._taken = _CONSUMER.unpack_from(
            m.mm, m.base + _CONSUMER_AT
        )
        self._end = -1  # end of the acquired batch; -1 when none is acquired
        if acquired:
            _, start, count, _ = m.entry(self._batch)
            self._end = start + count
        # Posts taken beyond the batches read were close posts: the ring was closed and
        # drained before this consumer came.
        self._closed = self._taken > self._batch + acquired
        if died_attached:
            self._adopt_unrecorded_posts()

    def _adopt_unrecorded_posts(self, settle_s: float = 0.01) -> None:
        """Take over data posts that were acquired but never recorded: by a consumer
        SIGKILLed between the two, or (seen when idle) by this one's own lag.

        Posts made are ``pushed`` (+2 once closed), one fewer while a push is between
        storing ``pushed`` and posting; posts taken are posts made minus the semaphore's
        value. A reading that holds still for ``settle_s`` has no push in flight; one
        that never holds still (a busy producer) is counted one low, which is safe: the
        post is found at the next idle check."""
        m = self._m
        last = None
        deadline = time.monotonic() + 10 * settle_s
        while True:
            pushed, _, closed = struct.unpack_from("<QQQ", m.mm, m.base + _PRODUCER_AT)
            reading = (pushed, closed, m.data.value)
            unrecorded = pushed + 2 * closed - reading[2] - self._taken
            if unrecorded <= 0:
                return  # the common case, decided by one reading
            if reading == last:
                break
            if time.monotonic() > deadline:
                unrecorded -= 1
                break
            last = reading
            time.sleep(settle_s)
        if unrecorded <= 0:
            return
        log.warning("ring %s: adopting %d data post(s) taken but not recorded", m.name, unrecorded)
        # A post and wait of our own synchronises us with every earlier post (all
        # operations on a semaphore are read-modify-writes in one release sequence).
        m.data.release()
        m.data.acquire(1.0)
        self._taken += unrecorded
        self._owed += unrecorded

    def _persist(self) -> None:
        _CONSUMER.pack_into(
            self._mm,
            PAYLOAD_OFFSET + _CONSUMER_AT,
            self._tail,
            self._batch,
            self._end >= 0,
            self._taken,
        )

    def _finish_batch(self) -> None:
        self._batch += 1
        self._end = -1
        self._persist()
        self._m.space.release()

    def _next_post(self) -> bool:
        """Acquire the next data post without blocking. True if it covers a batch (now
        the current one); False if there is none, or it was a close post. The posts
        not yet recorded are at most those of the batches ``_pull`` is copying."""
        if self._owed:
            self._owed -= 1
        else:
            # The value is only a hint (a plain read): it saves the ~1 us of a failing
            # trywait's exception. What is read is still decided by the trywait.
            if not self._sem.value:
                return False
            try:
                self._sem.acquire(0)
            except posix_ipc.BusyError:
                return False
            self._taken += 1
        return self._take_post()

    def _take_post(self) -> bool:
        """Act on a post just acquired (and counted in ``_taken``)."""
        batch = self._batch
        seq, start, count, _ = _ENTRY.unpack_from(
            self._mm, self._table_at + _ENTRY.size * (batch % self._cap)
        )
        if seq == batch:
            self._tail = start
            self._end = start + count
            return True
        if self._m.u64(_PRODUCER_CLOSED):
            self._closed = True
        self._persist()
        return False

    def _ready(self) -> bool:
        """True if a batch with unread records is acquired; never blocks."""
        while self._tail >= self._end:
            if self._end >= 0:
                self._finish_batch()
            if not self._next_post() and self._end < 0:
                return False
        return True

    def _wait(self, timeout: float | None) -> None:
        """Block until a batch is ready; RingEmpty on timeout, RingClosed when drained."""
        if self._ready():
            return
        if self._closed:
            raise RingClosed(f"ring {self._m.name} is closed and drained")
        if timeout is not None and timeout <= 0:
            raise RingEmpty
        start = time.monotonic()
        spin_until = start + self.spin_s
        while time.monotonic() < spin_until:  # bounded: see DEFAULT_SPIN_S
            if self._ready():
                return
        deadline = None if timeout is None else start + timeout
        while True:
            if self._closed:
                raise RingClosed(f"ring {self._m.name} is closed and drained")
            remaining = _IDLE_CHECK_S if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                raise RingEmpty
            try:
                self._m.data.acquire(min(remaining, _IDLE_CHECK_S))
            except posix_ipc.BusyError:
                # Idle: the producer may be blocked on a full ring while a post this
                # consumer never recorded keeps it waiting for data. Look for one.
                self._adopt_unrecorded_posts()
                if self._owed and self._ready():
                    return
                continue
            self._taken += 1
            self._take_post()
            if self._ready():
                return

    def try_pop(self) -> tuple:
        """One record as a tuple; RingEmpty if none, RingClosed if closed and drained."""
        return self.pop(timeout=0)

    def pop(self, timeout: float | None = None) -> tuple:
        """One record, waiting up to ``timeout`` seconds (None: forever).

        Records already in the ring beyond the first (up to ``prefetch``) come along in
        the same copy and are served from this process's memory: a consumer that has
        fallen behind catches up in bulk instead of paying cross-core cache misses per
        record. Like every popped record, they are delivered at most once."""
        pos = self._buf_pos
        if pos < len(self._buf):
            self._buf_pos = pos + self._size
            return self._unpack(self._buf, pos)
        if self._tail >= self._end:
            self._wait(timeout)  # now a batch is held
        tail = self._tail
        if tail + 1 == self._end and not self._sem.value:
            # No backlog: read the one record in place rather than copying out a batch.
            rec = self._unpack(self._mm, self._at + (tail % self._cap) * self._size)
            self._tail = tail + 1
            self._finish_batch()
            return rec
        self._buf = self._pull(self.prefetch, timeout)
        self._buf_pos = self._size
        return self._unpack(self._buf, 0)

    def pop_batch(self, max_records: int, timeout: float | None = 0) -> np.ndarray:
        """Up to ``max_records`` records as a structured array (at least one), waiting up
        to ``timeout`` for the first."""
        pos = self._buf_pos
        if pos < len(self._buf):  # what pop prefetched comes first
            end = min(len(self._buf), pos + max_records * self._size)
            self._buf_pos = end
            return np.frombuffer(self._buf[pos:end], self._dtype)
        return np.frombuffer(self._pull(max_records, timeout), self._dtype)

    def _pull(self, max_records: int, timeout: float | None) -> bytes:
        """Copy up to ``max_records`` records out of the ring (at least one, waiting up to
        ``timeout`` for it). Consecutive batches already posted come in one copy; their
        posts are recorded, and their space handed back, once the copy is made."""
        if self._tail >= self._end:
            self._wait(timeout)
        start = self._tail
        limit = start + max_records
        finished = 0
        while self._end <= limit:  # the current batch is taken whole
            finished += 1
            self._batch += 1
            stop = self._end
            self._end = -1
            if stop == limit or not self._next_post():
                break
        else:
            stop = limit
        self._tail = stop
        out = self._m.records(start, stop - start)
        self._persist()  # before handing space back: see the crash notes above
        for _ in range(finished):
            self._space_post()
        return out

    def close(self) -> None:
        """Detach; a new consumer may attach and continue where this one stopped.
        Idempotent."""
        if self._m is not None:
            self._m.set_u64(_CONSUMER_PID, 0)
            self._m.close()
            self._m = None
