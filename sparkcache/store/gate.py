"""The lookup gate of one rank: ``rank-<r>/lookup.lock``, an ``flock`` that makes a
lookup and its lease one step as seen by eviction.

The engine reads the index read-only, so the lease a lookup takes is a request that the
maintenance worker writes later. Without the gate an eviction transaction could remove a
root after the lookup read it but before the lease request reached maintenance, and the
restore that follows would miss. With it:

* a lookup holds the gate *shared* (never waiting: it tries for a moment, else the lookup
  is a miss) while it reads the index and pushes its lease request;
* maintenance holds it *exclusive* from after its write transaction began until after it
  committed, and first drains the request ring inside that transaction.

So a lookup's read and push happen either wholly before an eviction (whose drain then
applies the lease before choosing victims) or wholly after it (and then the read already
sees what the eviction removed). ``flock`` is a kernel lock: taking and releasing it orders
memory between the two processes like any lock, and the kernel releases the lock of a
process that dies holding it, so a crash can never leave lookups shut out.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from sparkcache.store.layout import DIR_FLAGS, FILE_MODE

GATE_NAME = "lookup.lock"
# Lookups try this long for the shared gate before counting a miss; eviction holds it for
# one bounded transaction.
SHARED_WAIT_S = 0.002


class LookupGate:
    def __init__(self, rank_dir: Path, create: bool) -> None:
        """Open (``create``: or create, 0600) the gate of a checked rank directory,
        without following links."""
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        if create:
            flags |= os.O_CREAT
        dir_fd = os.open(rank_dir, DIR_FLAGS)
        try:
            self._fd = os.open(GATE_NAME, flags, FILE_MODE, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def try_shared(self, wait_s: float = SHARED_WAIT_S) -> bool:
        """Take the gate shared within ``wait_s``; False (not taken) if eviction holds it."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.0002)

    def release(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
