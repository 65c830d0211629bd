"""Reading a run of a pack's records past the page cache (``O_DIRECT``), several requests
in flight, each record verified in this reader's own buffers before its payload is copied
out.

Why: a buffered restore allocates page cache for every byte it reads and the kernel
copies each byte out of it. On the 2-core guest these figures come from, that capped a
restore at 2.5-2.7 GiB/s, and where the host had taken the guest's free memory back, the
page cache's first use of it was slow (docs/vllm.md, "The slow rounds are the host
re-backing memory"). Read direct, the disk writes straight into these buffers: the
worker's path read 4,096 pages at 3.0-3.1 GiB/s with no slow round, 0.85-0.91 of one
file read front to back in its good rounds (docs/store.md, "Reading a pack past the page
cache"). It also leaves the page cache to the serving host.

A pack's records start on 4 KiB boundaries and are padded to the next one
(``objects.RECORD_ALIGN``), so a run of whole records is a block-aligned extent, which
``O_DIRECT`` requires of the file offset, the length and the memory (the buffers here are
anonymous mappings: page-aligned). Requests are whole records, at most ``REQUEST_BYTES``
(one record where a record is larger), issued ``IN_FLIGHT`` at a time on a thread pool
the caller shares between its readers (``os.preadv`` releases the GIL), and handled in
order as they complete: every record's header and checksum checked in the buffer, then
its payload copied into the caller's buffer. A record that fails is never copied; the
caller's buffer for it is zeroed, as a buffered read leaves it.

A run most of whose pages are in the page cache (just committed, or read moments ago) is
read through it instead, where copying from memory beats the disk (``mostly_cached``, the
kernel's ``cachestat``, which reads nothing; a probe read with ``RWF_NOWAIT`` was tried
first, but it brings the block it probes into the cache, so the next restore of the run
took it for cached).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass

from sparkcache.store.fileops import FileOps
from sparkcache.store.objects import (
    HEADER_SIZE,
    ObjectCorrupt,
    check_header,
    record_span,
    zero,
)

# 2 MiB requests, 16 in flight: 3.5-3.6 GiB/s from this guest's disk where 4 in flight
# read 3.4 and 128 KiB requests 1.9-2.7 (a throwaway probe of 1 GiB, three rounds each;
# docs/store.md). 34 MiB of buffers per reader (one huge page more, to align them).
REQUEST_BYTES = 2 << 20
IN_FLIGHT = 16
# cachestat(2) (Linux 6.5): the same number on every architecture.
_SYS_CACHESTAT = 451
_PAGE = os.sysconf("SC_PAGE_SIZE")
_HUGE = 2 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_have_cachestat = True


class _CachestatRange(ctypes.Structure):
    _fields_ = (("off", ctypes.c_uint64), ("len", ctypes.c_uint64))


class _Cachestat(ctypes.Structure):
    _fields_ = tuple((name, ctypes.c_uint64) for name in (
        "nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted"))


@dataclass(frozen=True)
class Pending:
    """One record of the run: where it lies in the pack and where its payload goes."""

    key: str
    generation: str
    size: int
    offset: int
    into: memoryview | list[memoryview]


def mostly_cached(fd: int, offset: int, length: int) -> bool:
    """Whether at least half the pages of ``fd``'s byte range are in the page cache; False
    where the kernel cannot say (before Linux 6.5: every run is read direct)."""
    global _have_cachestat
    if not _have_cachestat:
        return False
    stat = _Cachestat()
    if _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(_CachestatRange(offset, length)),
                     ctypes.byref(stat), 0) != 0:
        _have_cachestat = False  # ENOSYS; any other error there is the same answer
        return False
    return 2 * stat.nr_cache * _PAGE >= length


def supported(error: OSError) -> bool:
    """False for the errors of a filesystem that takes no ``O_DIRECT`` (tmpfs before
    Linux 6.6), or a device that takes none at a record's alignment."""
    return error.errno not in (errno.EINVAL, errno.EOPNOTSUPP)


class DirectReads:
    """One reader's buffers for direct reads; the thread pool is shared."""

    def __init__(self, pool: Executor) -> None:
        self._pool = pool
        self._mapping: mmap.mmap | None = None
        self._buffers: list[memoryview] = []
        # Made and touched now, while the reader opens (the worker is idle), not in a
        # restore's time: the first direct restore otherwise paid their page faults.
        self._ensure(REQUEST_BYTES)

    def close(self) -> None:
        for buf in self._buffers:
            buf.release()
        self._buffers = []
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None

    def read_run(self, ops: FileOps, fd: int,
                 run: Sequence[Pending]) -> tuple[int, Exception | None]:
        """Read ``run`` (records laid end to end in the pack open as ``fd`` with
        ``O_DIRECT``) through ``ops`` and copy each verified payload into its ``into``.
        Returns how many leading records were copied, and the ``ObjectCorrupt`` or
        ``OSError`` that stopped it (None if none did)."""
        groups = _requests(run)
        self._ensure(max(_length(g) for g in groups))
        free = list(range(len(self._buffers)))
        inflight: deque[tuple[list[Pending], int, Future]] = deque()
        todo = iter(groups)

        def issue() -> None:
            group = next(todo, None)
            if group is not None:
                slot = free.pop()
                view = self._buffers[slot][: _length(group)]
                inflight.append((group, slot, self._pool.submit(
                    ops.readinto, fd, [view], group[0].offset)))

        for _ in range(min(IN_FLIGHT, len(groups))):
            issue()
        done = 0
        try:
            while inflight:
                group, slot, fut = inflight.popleft()
                got = fut.result()
                buf = self._buffers[slot]
                for rec in group:
                    at = rec.offset - group[0].offset
                    _verify_and_copy(buf, at, got, rec)
                    done += 1
                free.append(slot)
                issue()
        except (ObjectCorrupt, OSError) as exc:
            # Without its traceback, whose frames hold views of the buffers: the mapping
            # could not be closed while it lived.
            return done, exc.with_traceback(None)
        finally:
            for _, _, fut in inflight:  # their buffers are reused, their fd closed next
                fut.exception()
        return done, None

    def _ensure(self, need: int) -> None:
        """``IN_FLIGHT`` buffers of at least ``need`` bytes, in huge pages where the
        kernel has them, touched."""
        if self._buffers and self._buffers[0].nbytes >= need:
            return
        self.close()
        slot = -(-need // _HUGE) * _HUGE
        # Private (Python's default anonymous mapping is shared memory, which takes no
        # transparent huge pages), and one huge page more, to start on a boundary.
        self._mapping = mmap.mmap(-1, slot * IN_FLIGHT + _HUGE,
                                  flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with contextlib.suppress(AttributeError, OSError):  # no THP: 4 KiB pages
            self._mapping.madvise(mmap.MADV_HUGEPAGE)
        whole = memoryview(self._mapping)
        start = -ctypes.addressof(ctypes.c_char.from_buffer(self._mapping)) % _HUGE
        self._buffers = [whole[start + i * slot : start + (i + 1) * slot]
                         for i in range(IN_FLIGHT)]
        for buf in self._buffers:
            buf[:] = bytes(slot)


def _length(group: list[Pending]) -> int:
    """Bytes of the pack one request reads: its records, padding included."""
    return group[-1].offset + record_span(group[-1].size) - group[0].offset


def _requests(run: Sequence[Pending]) -> list[list[Pending]]:
    """``run`` cut into requests of whole records, each at most ``REQUEST_BYTES`` (or one
    record)."""
    groups: list[list[Pending]] = []
    for rec in run:
        if groups:
            first = groups[-1][0]
            if rec.offset + record_span(rec.size) - first.offset <= REQUEST_BYTES:
                groups[-1].append(rec)
                continue
        groups.append([rec])
    return groups


def _verify_and_copy(buf: memoryview, at: int, got: int, rec: Pending) -> None:
    """Check ``rec`` in ``buf`` (``got`` bytes read from the start of its request), then
    copy its payload out; on failure zero its destination and raise ObjectCorrupt."""
    pieces = rec.into if isinstance(rec.into, list) else [rec.into[: rec.size]]
    try:
        if got < at + HEADER_SIZE + rec.size:
            raise ObjectCorrupt("short read")
        payload = buf[at + HEADER_SIZE : at + HEADER_SIZE + rec.size]
        check_header(bytearray(buf[at : at + HEADER_SIZE]), rec.key, rec.generation,
                     rec.size, [payload])
    except ObjectCorrupt:
        zero(pieces)
        raise
    start = 0
    for piece in pieces:
        piece[:] = payload[start : start + piece.nbytes]
        start += piece.nbytes
