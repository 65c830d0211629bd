"""Faulting the capture slots in behind READY.

The supervisor allocates the arena's pages when it makes it (``RankSegments.create``),
so a full /dev/shm fails the start rather than a copy; what is left for a slot's first
touch is a fault per page to map it into capture (and, in an arena made unallocated, to
allocate and zero it), which a slot's first publication would pay inside its deadline.
Capture used to touch every slot before it reported READY: with the default of then, 2 x
3 GiB a rank, that took tens of seconds on a small host and put the whole arena in
capture's RSS before the supervisor even saw it start. Now a thread does it after READY,
slot by slot in bounded chunks, and reports its progress
(``Lifecycle.prefaulted_bytes``, published in the stats block by the worker's own
beats). A publication that arrives first is still taken: its copy faults the pages it
writes, as any copy into a fresh slot would.

How: ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14) faults pages in writable without
changing a byte, so it is safe while capture copies into the same slot; it runs in C with
the GIL released (ctypes), and the thread runs at the lowest priority so capture's own
thread, and the rank's other workers, come first on a shared core. On an older kernel it
falls back to reading one byte per page, which on tmpfs allocates the page too.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import threading
from collections.abc import Callable

import numpy as np
from sparkcache.shm import SlotArena

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # <linux/mman.h>; Python's mmap module does not name it (3.11)
CHUNK = 64 * 1024 * 1024  # per call: how soon a stop is seen (~0.1 s at 0.6 GiB/s)
FALLBACK_CHUNK = 8 * 1024 * 1024  # the read fallback holds the GIL while it runs
PAGE = os.sysconf("SC_PAGE_SIZE")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


class Prefaulter:
    """Faults every slot of ``arena`` in, from a background thread, calling
    ``progress(bytes done)`` after each chunk. ``stop()`` before closing the arena."""

    def __init__(self, arena: SlotArena, progress: Callable[[int], None]) -> None:
        first = arena.slot_array(0)
        # Addresses only: a numpy view kept by the thread would stop the arena's mapping
        # from closing.
        self._start = first.ctypes.data
        del first
        self.total = arena.slots * arena.slot_bytes
        self._progress = progress
        self._stop = threading.Event()
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sparkcache-prefault",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        # Lowest priority for this thread alone (on Linux a thread has its own nice value).
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        touch = self._populate
        at = 0
        try:
            while at < self.total and not self._stop.is_set():
                n = min(CHUNK if touch == self._populate else FALLBACK_CHUNK, self.total - at)
                try:
                    touch(self._start + at, n)
                except OSError as exc:
                    if touch != self._populate or exc.errno not in (errno.EINVAL, errno.ENOSYS):
                        raise
                    log.info("MADV_POPULATE_WRITE unsupported; prefaulting by reading")
                    touch = self._read
                    continue
                at += n
                self._progress(at)
        except Exception:
            # Pages not faulted now fault inside the copies; never worth failing capture.
            log.exception("prefault stopped at %d of %d bytes", at, self.total)
        finally:
            self.done.set()

    @staticmethod
    def _populate(addr: int, n: int) -> None:
        # madvise wants a page-aligned start; the slots start 64 bytes into a page (the
        # segment header), so the range may take in the arena's state page: populating
        # changes no byte, so that is harmless.
        start = addr - addr % PAGE
        if _libc.madvise(start, n + (addr - start), MADV_POPULATE_WRITE) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))

    @staticmethod
    def _read(addr: int, n: int) -> None:
        pages = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))
        int(pages[::PAGE].max())  # one read per page: tmpfs allocates it
