"""Single-producer single-consumer ring of fixed-size records in shared memory.

Byte layout of the payload (after the segment header), RING_LAYOUT_VERSION 2, all u64
little-endian; each group starts on its own 128-byte line so the producer and the
consumer never write the same cache line:

    0    META      capacity, itemsize, record_version, record_name (32 bytes)
    128  PRODUCER  posted (data posts made), freed (batches reused), closed, pid
    256  CONSUMER  tail (next record), batch (batches finished), taken (data posts
                   taken), pid, returned (batches whose space is handed back)
    384  TABLE     2 * capacity + 2 entries of (end, seq): one per pushed batch
    R    RECORDS   capacity records, R = 384 + 16 * (2 * capacity + 2) rounded up to 128

Memory ordering. Python cannot issue fences, and on arm64 a plain store may become
visible to another core before stores that preceded it. So no index is ever trusted
because it *looks* advanced: every cross-process hand-over goes through a POSIX
semaphore, whose post is a release and whose successful wait/trywait is an acquire.

* ``data``, posted once per pushed batch after the producer wrote its records and its
  TABLE entry. The consumer counts the posts it takes (``taken``): after its m-th, at
  least m posts precede it in the semaphore's modification order, and because every
  operation on a semaphore is a read-modify-write its acquire synchronises with all of
  them. So it reads TABLE entries 0..m-1 and their records, never the producer's
  counters. An entry whose seq is not its index means no batch: the post was a close.
  A consumer that is behind reads ``value`` once and takes that many posts (only it
  takes them, so none can block), then copies all their records in one slice.
* ``space``, posted by the consumer before and after it stores ``returned``, a
  cumulative count of the batches it has copied out. The producer reads ``returned``,
  then posts ``space`` and takes that post back, which synchronises it with the
  consumer's first post: only then does it overwrite those records. Space posts are not
  counted (a surplus one is harmless); the second wakes a producer that slept and read
  ``returned`` before it was stored.

``posted`` and ``returned`` are the only counters read across processes, and they are
read as lower bounds: each is stored right after a post, so it never counts what that
post does not cover, and the reader reads it, then posts the semaphore and takes a post
back. On x86 the order is plain; on arm64 glibc's sem_post is a compare-and-swap loop
whose result the writer's later store depends on, so a post ordered after reading that
store cannot precede the writer's post in the semaphore's order (the cycle is
forbidden), and the take that follows synchronises with it.

Adoption. A consumer SIGKILLed between taking data posts and recording them leaves them
taken by nobody; its successor would run that many posts behind, and a full ring would
deadlock. posted - value - taken is a lower bound on those posts: never a phantom, exact
unless a push is between its post and its store of ``posted``. Consumer._adopt checks it
at a killed consumer's successor's first post and whenever the consumer takes a post
after sleeping, and reads the adopted batches under that post. A producer that finds no
space while the consumer holds no post pushes an empty batch, so a consumer that needs
a post of its own always gets one (Producer._reserve).

Batches are the unit of hand-over: space returns to the producer batch by batch, so a
batch the consumer has half read still occupies its records. docs/shm.md lists the
crash windows.

Trusting no entry. A TABLE entry is the producer's word, and a stray write (or an end
used from a forked child, which the ends refuse: ``_forget_in_child``) could make one
say anything. A consumer that believed a huge ``end`` replayed stale records forever. So
each batch's ``end`` must lie between its predecessor's and the consumer's tail plus the
capacity (the producer never writes past the oldest batch not yet returned, which starts
at or before the tail), a post with no batch must come with ``closed`` set (stored
before the close posts), and adoption may take no more posts than batches fit in flight.
A violation raises ``RingCorrupt``: what the ring holds can no longer be told from what
it held, so the ring is not read again; a new supervisor makes new rings.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import time
import weakref
from collections import deque

import numpy as np
import posix_ipc
from sparkcache.shm.records import RecordLayout
from sparkcache.shm.segment import (
    PAYLOAD_OFFSET,
    SEGMENT_MODE,
    SHM_DIR,
    Segment,
    SegmentError,
    SegmentSpec,
    open_semaphore,
)

log = logging.getLogger(__name__)

RING_LAYOUT_VERSION = 2
RING_KIND = "ring"

_LINE = 128
_META = struct.Struct("<QQQ32s")  # capacity, itemsize, record_version, record_name
_META_AT = 0
# The rest are u64 words (their payload byte offsets below), each stored with one 8-byte
# store through a word view of the mapping: struct.pack_into zeroes its destination
# before it writes, so a process killed inside one would leave zeros.
_POSTED = _LINE
_FREED = _LINE + 8
_CLOSED = _LINE + 16
_PRODUCER_PID = _LINE + 24
_TAIL = 2 * _LINE  # tail, batch, taken: consecutive, persisted together
_BATCH = _TAIL + 8
_TAKEN = _TAIL + 16
_CONSUMER_PID = _TAIL + 24
_RETURNED = _TAIL + 32
_TABLE_AT = 3 * _LINE
# A TABLE entry is end, then seq: seq is stored last, so a killed producer's entry whose
# seq matches its index is whole.
_ENTRY_WORDS = 2
_NO_SEQ = 2**64 - 1
# Close posts: the second is for a consumer that must take a post of its own before it
# can read what a killed predecessor took (see Consumer._adopt).
_CLOSE_POSTS = 2

# Default bounded spin before sleeping: long enough to catch a busy producer's next post
# (round trips stay ~microseconds), short enough that an idle consumer costs nothing.
DEFAULT_SPIN_S = 50e-6
# Records a single pop may copy out at once when the ring holds a backlog.
DEFAULT_PREFETCH = 64


class RingFull(queue.Full):
    """No space for the records; nothing was written."""


class RingEmpty(queue.Empty):
    """No record was available (within the timeout)."""


class RingClosed(Exception):
    """The producer closed the ring and every record has been read."""


class RingCorrupt(SegmentError):
    """The ring's shared words say what its protocol cannot (module notes, "Trusting no
    entry"), or an end is used in a forked child: never read or written again."""


# Every end of this process: in a forked child they are left inert (``_forget_in_child``).
_ENDS: weakref.WeakSet[Producer | Consumer] = weakref.WeakSet()


def _forget_in_child() -> None:
    """After a fork, in the child: its copies of this process's ends touch nothing shared.
    A child pushing through its parent's producer wrote TABLE entries the parent then
    overwrote (two producers of one ring), and a child's close at exit would have closed
    the parent's ring. Any later use raises ``RingCorrupt``; close and detach only drop
    the child's mapping."""
    for end in list(_ENDS):
        end._forked = True
        end._limit = -1  # a producer's every push now asks _reserve, which refuses
        end._buf, end._buf_pos = b"", 0  # a consumer's prefetched records stay the parent's


os.register_at_fork(after_in_child=_forget_in_child)


def _entries(capacity: int) -> int:
    # Batches in flight: at most capacity non-empty ones, plus the empty batches a
    # blocked producer pushes (Producer._reserve); the producer never fills the table
    # (Producer._space_limit), this leaves room for as many empty batches.
    return 2 * capacity + 2


def _records_at(capacity: int) -> int:
    end = _TABLE_AT + 8 * _ENTRY_WORDS * _entries(capacity)
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
        self.entries = _entries(capacity)
        self.itemsize = itemsize
        self.records_at = self.base + _records_at(capacity)
        self._check_records(version, rname.rstrip(b"\0").decode(errors="replace"))
        data_name, space_name = _sem_names(seg.name)
        # Checked like the segment: ours, mode 0600 (shm.segment.open_semaphore).
        self.data, self.space = open_semaphore(data_name), open_semaphore(space_name)
        self.words = memoryview(self.mm)[: self.records_at].cast("Q")  # last: see close
        self.table_word = self.word(_TABLE_AT)

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

    def word(self, at: int) -> int:
        """Index in ``words`` of the u64 at payload offset ``at``."""
        return (self.base + at) // 8

    def entry(self, k: int) -> tuple[int, int]:
        """(end, seq) of batch ``k``'s TABLE slot."""
        i = self.table_word + _ENTRY_WORDS * (k % self.entries)
        return self.words[i], self.words[i + 1]

    def u64(self, at: int) -> int:
        return self.words[self.word(at)]

    def set_u64(self, at: int, value: int) -> None:
        self.words[self.word(at)] = value

    def batches_posted(self) -> int:
        """Batches among the ``posted`` data posts (the rest were close posts)."""
        posted = self.u64(_POSTED)
        for k in range(posted, max(0, posted - _CLOSE_POSTS) - 1, -1):
            if k == 0 or self.entry(k - 1)[1] == k - 1:
                return k
        return 0

    def records(self, start: int, count: int) -> bytes:
        """Copy ``count`` records' bytes from ring position ``start`` (wrapping)."""
        first = min(count, self.capacity - start % self.capacity)
        at = self.records_at + (start % self.capacity) * self.itemsize
        out = self.mm[at : at + first * self.itemsize]
        if first < count:
            out += self.mm[self.records_at : self.records_at + (count - first) * self.itemsize]
        return out

    def close(self) -> None:
        self.words.release()  # a mapping cannot close under a live view
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
        seg = Segment.create(name, _spec(layout), size, reserve=True)
        created: list[str] = []
        try:
            _META.pack_into(
                seg.mm, PAYLOAD_OFFSET + _META_AT, capacity, layout.itemsize, layout.version,
                layout.name.encode(),
            )
            table = seg.array("<u8", _TABLE_AT, _ENTRY_WORDS * _entries(capacity))
            table[1::_ENTRY_WORDS] = _NO_SEQ
            del table
            for sem_name in _sem_names(name):
                posix_ipc.Semaphore(sem_name, posix_ipc.O_CREX, mode=SEGMENT_MODE, initial_value=0)
                created.append(sem_name)
                # sem_open applies the umask, as shm_open does (Segment.create): under one
                # that takes the owner's bits, every end's open_semaphore refused it.
                # Just created in sticky /dev/shm: nobody else can have replaced it.
                os.chmod(SHM_DIR / ("sem." + sem_name.lstrip("/")), SEGMENT_MODE)
            return cls(_RingMapping(seg, layout))
        except BaseException:
            for sem_name in created:
                posix_ipc.unlink_semaphore(sem_name)
            seg.close()
            raise

    @classmethod
    def attach(cls, name: str, layout: RecordLayout) -> Ring:
        """Attach as an observer (depth); reads only, never hands over."""
        return cls(_RingMapping(Segment.attach(name, _spec(layout)), layout))

    def depth(self) -> int:
        """Records pushed and not yet read. Read without synchronisation: a gauge, which
        may lag by a batch; never use it to decide what to read."""
        m = self._m
        pushed = m.batches_posted()
        if pushed == 0:
            return 0
        return max(0, m.entry(pushed - 1)[0] - m.u64(_TAIL))

    def batch_counts(self) -> tuple[int, int]:
        """(batches pushed, batches the consumer finished), read without synchronisation
        like ``depth``: gauges for a reader that counts whole batches (a load is one)."""
        m = self._m
        return m.batches_posted(), m.u64(_BATCH)

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


def _maps_segment(pid: int, name: str) -> bool:
    """Whether process ``pid`` is alive with segment ``name`` mapped. Its pid alone is not
    enough: an end killed while attached leaves its pid in the ring, and the kernel may
    have given that pid to an unrelated process since, which would lock the ring's end
    out until that process exits. Where its mappings cannot be read (another user's
    process), the process exists, and counts, as any live pid always did."""
    path = str(SHM_DIR / name.lstrip("/"))
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            # The path is the sixth field; " (deleted)" follows it once unlinked. Exact:
            # one ring's name may begin another's (load, loaded).
            return any(line.split(maxsplit=5)[5:] in ([path + "\n"], [path + " (deleted)\n"])
                       for line in f)
    except (FileNotFoundError, ProcessLookupError):
        return False  # no such process
    except OSError:
        return True


def _claim_end(m: _RingMapping, pid_at: int, role: str) -> bool:
    """Record this process as the ring's ``role``. True if the previous one died attached
    (or is alive but no longer maps the ring: its pid was reused)."""
    pid = m.u64(pid_at)
    if pid and _maps_segment(pid, m.name):
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
        # pack(*record) then a slice copy: pack_into(mm, at, *record) must build a new
        # argument tuple, which costs more than the copy
        self._pack = layout.packer.pack
        self._dtype = layout.dtype
        self._mm = m.mm
        self._size = m.itemsize
        self._records_at = m.records_at
        self._words = m.words
        self._table_word = m.table_word
        self._entries = m.entries
        self._posted_word = m.word(_POSTED)
        # The one call that publishes a push. Tests wrap it to stall a producer between
        # posting and storing ``posted``, the window adoption must not mistake for a post
        # taken unrecorded.
        self._post = m.data.release
        self._closed = bool(m.u64(_CLOSED))
        self._freed = m.u64(_FREED)
        # ``posted`` is one low if a producer was killed between its post and storing it,
        # and the batch after it may be whole but unposted. A whole entry (its seq is
        # written last) counts as pushed either way: the consumer may then adopt a post
        # that was never made, for records a process that is gone wrote in full.
        k = m.batches_posted()
        if not self._closed and m.entry(k)[1] == k:
            k += 1
        if m.u64(_POSTED) < k:
            m.set_u64(_POSTED, k)
        self._k = k  # batches pushed
        self._head = m.entry(k - 1)[0] if k else 0
        if self._closed:
            # Finish a close a killed producer began; a surplus close post is harmless
            # (no batch ever follows it).
            for _ in range(k + _CLOSE_POSTS - m.u64(_POSTED)):
                m.data.release()
                m.set_u64(_POSTED, m.u64(_POSTED) + 1)
            self._limit = -1
        else:
            self._limit = self._space_limit()
        self._forked = False
        _ENDS.add(self)

    def _start_of(self, k: int) -> int:
        """Ring position where batch ``k`` starts; its predecessor's entry is intact
        while fewer than ``_entries`` batches are in flight."""
        return self._m.entry(k - 1)[0] if k else 0

    def _space_limit(self) -> int:
        """Ring position up to which the producer may write: the start of the oldest
        batch not yet returned plus the capacity, and no further than the free TABLE
        entries allow (every push takes at least one record and one entry)."""
        in_flight = self._k - self._freed
        return min(self._start_of(self._freed) + self.capacity,
                   self._head + self._entries - 1 - in_flight)

    def _take_space(self) -> None:
        """Take the space posts already made (one ``value`` read: only this producer
        takes them, so none of these waits can block) and reuse the batches the
        consumer has returned.

        ``returned`` is stored by the consumer after a space post, so it never counts a
        batch that post does not cover; it is read before a post of this producer's own
        that is then taken back, which synchronises with the consumer's post (the same
        argument as for ``posted``, see the module notes): only then may the records of
        those batches be overwritten. Space posts are not counted, so a post given back
        and not yet taken again when this producer is killed is harmless."""
        space = self._m.space
        for _ in range(space.value):
            space.acquire()
        returned = self._m.u64(_RETURNED)
        if returned <= self._freed:
            return
        space.release()
        space.acquire()  # cannot block: the value is at least the post given back
        self._freed = returned
        self._m.set_u64(_FREED, returned)
        self._limit = self._space_limit()

    def _reserve(self, n: int, timeout: float) -> None:
        if self._forked:
            raise RingCorrupt(f"ring {self._m.name}: its producer was opened by process "
                              f"{self._m.u64(_PRODUCER_PID)}, not by this forked child")
        if self._closed:
            raise RingClosed(f"ring {self._m.name} is closed")
        if n > self.capacity:
            raise ValueError(f"{n} records cannot fit a ring of {self.capacity}")
        deadline = time.monotonic() + timeout
        while True:
            self._take_space()
            if self._head + n <= self._limit:
                return
            # Blocked, and the consumer holds no post: it may be one that cannot read,
            # or return, what it holds before it takes a post of its own (see
            # Consumer._adopt). An empty batch gives it one. A consumer posts space
            # before it sleeps, so this is looked at again then.
            if not self._m.data.value and self._k - self._freed < self._entries - 1:
                self._publish(self._head)
                self._limit = self._space_limit()  # it took an entry and no record
            wait = deadline - time.monotonic()
            if wait <= 0:
                break
            try:
                self._m.space.acquire(wait)
            except posix_ipc.BusyError:
                break
        raise RingFull(f"ring {self._m.name}: no space for {n} records")

    def _publish(self, end: int) -> None:
        """Publish the batch that ends at ring position ``end``: entry, post, ``posted``."""
        k = self._k
        w = self._words
        i = self._table_word + _ENTRY_WORDS * (k % self._entries)
        w[i] = end
        w[i + 1] = k
        self._post()  # release: the records and entry above are visible to its acquirer
        w[self._posted_word] = k + 1  # after: never counts a post not made
        self._k = k + 1
        self._head = end

    def try_push(self, record: tuple, timeout: float = 0.0) -> None:
        """Push one record (a tuple in field order); RingFull if there is no space."""
        head = self._head
        if head >= self._limit:
            self._reserve(1, timeout)
        mm = self._mm
        at = self._records_at + head % self.capacity * self._size
        mm[at : at + self._size] = self._pack(*record)
        # _publish(head + 1), inlined: a call costs as much as one of these steps
        k = self._k
        w = self._words
        i = self._table_word + _ENTRY_WORDS * (k % self._entries)
        w[i] = head + 1
        w[i + 1] = k
        self._post()
        w[self._posted_word] = k + 1
        self._k = k + 1
        self._head = head + 1

    def push_batch(self, records: np.ndarray, timeout: float = 0.0) -> None:
        """Push a structured array as one batch (all or nothing)."""
        n = len(records)
        if n == 0:
            return
        if records.dtype is not self._dtype and records.dtype != self._dtype:
            raise TypeError(f"records of dtype {records.dtype}: expected {self._dtype}")
        head = self._head
        if head + n > self._limit:
            self._reserve(n, timeout)
        pos = head % self.capacity
        try:
            if pos + n <= self.capacity:  # the common case, inlined: no wrap
                at = self._records_at + pos * self._size
                self._mm[at : at + n * self._size] = records  # its buffer is the raw bytes
            else:
                self._copy_wrapped(pos, records)
        except ValueError:  # not contiguous (checking first costs as much as the copy)
            self._copy_wrapped(pos, np.ascontiguousarray(records))
        # _publish(head + n), inlined like try_push's
        k = self._k
        w = self._words
        i = self._table_word + _ENTRY_WORDS * (k % self._entries)
        w[i] = head + n
        w[i + 1] = k
        self._post()
        w[self._posted_word] = k + 1
        self._k = k + 1
        self._head = head + n

    def _copy_wrapped(self, pos: int, records: np.ndarray) -> None:
        """Copy a contiguous structured array's bytes to ring index ``pos``, wrapping
        at the end of the ring if they do not fit before it."""
        n = len(records)
        at = self._records_at + pos * self._size
        if pos + n <= self.capacity:
            self._mm[at : at + n * self._size] = records  # its buffer is the raw bytes
        else:
            first = self.capacity - pos
            self._mm[at : at + first * self._size] = records[:first]
            self._mm[self._records_at : self._records_at + (n - first) * self._size] = (
                records[first:]
            )

    def close(self) -> None:
        """Tell the consumer no more records come, then detach."""
        m = self._m
        if m is None:
            return
        if self._forked:  # the parent's producer, not this child's to close
            self.detach()
            return
        self._closed = True
        self._limit = -1
        m.set_u64(_CLOSED, 1)
        for i in range(1, _CLOSE_POSTS + 1):
            m.data.release()
            m.set_u64(_POSTED, self._k + i)
        self.detach()

    def detach(self) -> None:
        """Leave the ring without closing it (a new producer may attach). Idempotent."""
        if self._m is not None:
            if not self._forked:
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
        self.adopted = 0  # data posts taken over from a predecessor killed holding them
        self._buf = b""  # records pop copied out but has not returned yet
        self._buf_pos = 0
        self._dtype = layout.dtype
        self._size = m.itemsize
        self._unpack = layout.packer.unpack_from
        self._words = m.words
        self._table_word = m.table_word
        self._entries = m.entries
        self._posted_word = m.word(_POSTED)
        self._tail_word = m.word(_TAIL)
        self._sem = m.data
        self._space_post = m.space.release
        self._returned_word = m.word(_RETURNED)
        self._tail, self._batch, self._taken = (m.u64(_TAIL), m.u64(_BATCH), m.u64(_TAKEN))
        self._returned = m.u64(_RETURNED)
        self._end = self._tail  # records before this position are covered by posts taken
        self._ends: deque[int] = deque()  # end of each batch taken and not finished
        self._closed = False
        # Entries are read for posts taken by this consumer only after a post of its
        # own: a predecessor that closed handed its posts back, a killed one did not,
        # and may have taken more without recording them.
        self._seen = self._batch
        self._adopt_due = died_attached or self._taken > self._batch
        self.capacity = m.capacity
        self._broken: str | None = None  # why the ring is never read again
        self._forked = False
        _ENDS.add(self)

    def _corrupt(self, what: str) -> RingCorrupt:
        """The error for a violation; the ring is never read again (a later call raises
        it again rather than read what follows)."""
        self._broken = f"ring {self._m.name} is corrupt: {what}; a new supervisor makes new rings"
        log.error("%s", self._broken)
        return RingCorrupt(self._broken)

    def _check_end(self, k: int, end: int) -> None:
        """Raise RingCorrupt unless batch ``k``'s ``end`` lies between its predecessor's
        end and the tail plus the capacity (module notes, "Trusting no entry")."""
        low = self._m.entry(k - 1)[0] if k else 0
        high = self._tail + self.capacity
        if not low <= end <= high:
            raise self._corrupt(f"batch {k} ends at record {end}, outside [{low}, {high}]")

    def _check_closed(self, k: int) -> None:
        """A post with no batch (entry ``k``'s seq is not ``k``) is a close only if the
        producer set ``closed`` first; else the entry was overwritten."""
        if not self._m.u64(_CLOSED):
            raise self._corrupt(f"post {k} has no batch and the ring is not closed")

    def _adopt(self) -> None:
        """Take over data posts a predecessor took but never recorded (it was killed
        between the two). Called right after this consumer took a post.

        Posts made are at least ``posted`` (the producer stores it after each post);
        posts taken are posts made minus the semaphore's value. So posted - value -
        taken is a lower bound on the posts taken unrecorded: exact when no push is
        between posting and storing ``posted``, and never a post that was not made or
        not taken. The post just taken is given back and taken again: the give-back is
        a release ordered after reading ``posted`` (so the value read after counts every
        post ``posted`` counts, see the module notes) and the second take synchronises
        with them all, so the adopted batches are read under it. Neither step can leave
        a post that nobody took: a kill between them leaves one post given back."""
        posted = self._words[self._posted_word]
        self._sem.release()
        self._sem.acquire()  # cannot block: the value is at least the post given back
        unrecorded = posted - self._sem.value - self._taken
        if unrecorded > self._entries + _CLOSE_POSTS:  # more than can be in flight
            raise self._corrupt(f"{unrecorded} data posts to adopt, where at most "
                                f"{self._entries + _CLOSE_POSTS} can be in flight")
        if unrecorded > 0:
            log.warning("ring %s: adopting %d data post(s) taken but not recorded",
                        self._m.name, unrecorded)
            self._taken += unrecorded
            self.adopted += unrecorded
        self._adopt_due = False

    def _read_entries(self) -> None:
        """Read the TABLE entries of the posts taken: each is a batch, or the close."""
        j = self._seen
        w = self._words
        while j < self._taken:
            i = self._table_word + _ENTRY_WORDS * (j % self._entries)
            end, seq = w[i], w[i + 1]
            if seq != j:  # no batch for this post: the producer closed the ring
                self._check_closed(j)
                self._closed = True
                j = self._taken
                break
            self._check_end(j, end)
            self._ends.append(end)
            # A killed predecessor may have recorded its tail and not yet the batches
            # it finished: those end at or before the tail.
            self._end = max(self._end, end)
            j += 1
        self._seen = j

    def _take(self, limit: int) -> None:
        """Take the posts already made, one at a time, until the records before ring
        position ``limit`` are covered, the posts run out, or the close is seen."""
        sem = self._sem
        n = sem.value  # only this consumer takes posts: none of these waits can block
        if not n or self._end >= limit or self._closed:
            return
        if self._adopt_due:
            sem.acquire()
            n -= 1
            self._taken += 1
            self._adopt()
            self._read_entries()
            if self._closed:
                return
        # _read_entries for one post at a time, inlined: this loop runs once per batch
        w, at, entries, ends = self._words, self._table_word, self._entries, self._ends
        j, end = self._taken, self._end
        # The most a valid batch can end at (module notes, "Trusting no entry").
        most = self._tail + self.capacity
        try:
            while n and end < limit:
                sem.acquire()
                n -= 1
                i = at + _ENTRY_WORDS * (j % entries)
                e = w[i]
                j += 1
                if w[i + 1] != j - 1:  # no batch for this post: the producer closed the ring
                    self._check_closed(j - 1)
                    self._closed = True
                    break
                # Its predecessor's entry is read under this post too.
                if not (w[at + _ENTRY_WORDS * ((j - 2) % entries)] if j > 1 else 0) <= e <= most:
                    self._check_end(j - 1, e)  # raises
                ends.append(e)
                end = e
        finally:
            self._taken = self._seen = j
            self._end = end

    def _wait(self, timeout: float | None) -> None:
        """Until a record past the tail is covered; RingEmpty on timeout, RingClosed
        when drained."""
        tail = self._tail
        self._take(tail + 1)
        if self._end > tail:
            return
        if not self._closed and timeout is not None and timeout <= 0:
            raise RingEmpty
        start = time.monotonic()
        spin_until = start + self.spin_s
        deadline = None if timeout is None else start + timeout
        while not self._closed:
            if time.monotonic() < spin_until:  # bounded: see DEFAULT_SPIN_S
                self._take(tail + 1)
            else:
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    raise RingEmpty
                self._before_sleep()
                try:
                    self._sem.acquire(wait)
                except posix_ipc.BusyError:
                    raise RingEmpty from None
                self._taken += 1
                # Woken from a sleep: the cheapest moment to look for posts taken
                # unrecorded, which are what a consumer may wait for in vain.
                self._adopt()
                self._read_entries()
            if self._end > tail:
                return
        raise RingClosed(f"ring {self._m.name} is closed and drained")

    def _before_sleep(self) -> None:
        """A producer blocked on space may be waiting for this consumer: return what it
        has finished (empty batches, or what a killed predecessor finished), or else
        wake the producer, which then gives it a post of its own (Producer._reserve)."""
        ends = self._ends
        while ends and ends[0] <= self._tail:
            ends.popleft()
            self._batch += 1
        if self._batch > self._returned:
            self._persist()
            self._return()
        elif not self._m.space.value:
            self._space_post()

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
        self._buf = buf = self._pull(self.prefetch, timeout)
        self._buf_pos = self._size
        return self._unpack(buf, 0)

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
        ``timeout`` for it), taking the posts already made for as many as fit. Finished
        batches are recorded, then their space handed back."""
        if self._broken or self._forked:
            raise RingCorrupt(self._broken or f"ring {self._m.name}: its consumer was opened "
                              "by the parent of this forked child")
        tail = self._tail
        if self._end <= tail:
            self._wait(timeout)
        limit = tail + max_records
        if self._end < limit:
            self._take(limit)
        stop = min(self._end, limit)
        out = self._m.records(tail, stop - tail)
        self._tail = stop
        ends = self._ends
        if stop == self._end:
            done = len(ends)
            ends.clear()
        else:
            done = 0
            while ends[0] <= stop:
                ends.popleft()
                done += 1
        self._batch += done
        self._persist()  # before handing space back: see the crash windows
        if done:
            self._return()
        return out

    def _return(self) -> None:
        """Hand the space of the finished batches back (see Producer._take_space)."""
        self._space_post()  # release: these batches are read
        # After the post: the producer reuses only batches a post precedes. A producer
        # that slept may have read ``returned`` before this store: the second post wakes
        # it to read it again.
        self._words[self._returned_word] = self._batch
        self._returned = self._batch
        self._space_post()

    def _persist(self) -> None:
        # After a kill any of these may be older than the others; each is whole.
        w, i = self._words, self._tail_word
        w[i] = self._tail
        w[i + 1] = self._batch
        w[i + 2] = self._taken

    def close(self) -> None:
        """Detach; a new consumer may attach and continue where this one stopped.
        Posts taken for batches not finished (and the close post) are handed back, so
        the next consumer takes them again under its own waits. Idempotent."""
        m = self._m
        if m is None:
            return
        if self._forked:  # the parent's consumer: this child only drops its mapping
            m.close()
            self._m = None
            return
        held = self._taken - self._batch
        self._taken = self._batch
        self._persist()  # first: a kill before the posts leaves them taken unrecorded
        for _ in range(held):
            m.data.release()
        m.set_u64(_CONSUMER_PID, 0)
        m.close()
        self._m = None
