"""The thin file-I/O layer the store goes through, so tests can inject faults.

Every system call the store makes on object files goes through a ``FileOps`` instance.
Tests subclass it to raise ``ENOSPC`` from ``write`` or ``EIO`` from a sync; the store
itself never special-cases a test. ``StepHook`` is called at each named step of the commit
and eviction protocols so a crash test can SIGKILL a child exactly at that step.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable

from sparkcache.store import durability

StepHook = Callable[[str], None]

# The named steps, in protocol order; crash tests iterate over these.
COMMIT_STEPS = (
    "commit.recycled",  # a pooled file renamed onto a temp name, its old bytes unwritten
    "commit.temp_write",  # a temp file is partly written (torn)
    "commit.written",  # a temp file is fully written and its writeback started, not durable
    "commit.rename",  # a temp file was renamed to its final name, nothing durable yet
    "commit.syncing",  # every file renamed, their sync begun, index transaction not begun
    "commit.index_txn",  # inside the index transaction, a publication's rows written
    "commit.durable",  # every file and name durable (one syncfs), the transaction not committed
)
EVICTION_STEPS = (
    "evict.select",  # victims selected, nothing removed
    "evict.remove",  # inside the removal transaction, before COMMIT
    "evict.truncated",  # a step committed that left a root cut short (store/eviction.py)
    "collect.select",  # inside the collection transaction, rows chosen, before DELETE
    "collect.delete",  # rows deleted, before COMMIT
    "collect.synced",  # a slice's deletions (committed without an fsync) made durable
    "collect.unlink",  # rows gone durably, before unlinking (or pooling) one file, or
    # punching one record out of a pack
    "collect.pooled",  # a collected file moved into the pool (store/pool.py)
    "collect.shrunk",  # a collected file the pool did not take, cut short by one step
)


def no_hook(step: str) -> None:
    """The default step hook: does nothing."""


class FileOps:
    """Plain POSIX calls; every path argument is a name relative to an open directory fd."""

    def open(self, name: str, flags: int, mode: int, dir_fd: int) -> int:
        return os.open(name, flags, mode, dir_fd=dir_fd)

    def write(self, fd: int, pieces: list[memoryview]) -> int:
        """Write the concatenation of ``pieces`` (one ``writev``); bytes written."""
        return os.writev(fd, pieces)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def start_writeback(self, fd: int, offset: int, nbytes: int) -> None:
        """Submit the dirty pages of ``nbytes`` at ``offset`` of ``fd`` to the disk without
        waiting (a hint, not a sync)."""
        durability.start_writeback(fd, offset, nbytes)

    def sync_filesystem(self, fd: int) -> None:
        """Make everything written to ``fd``'s filesystem durable (``syncfs``)."""
        durability.sync_filesystem(fd)

    @property
    def syncfs_reports_errors(self) -> bool:
        """Whether ``sync_filesystem`` raises for a page that could not be written (Linux
        5.8 on); where it does not, a commit fsyncs each file instead."""
        return durability.SYNCFS_REPORTS_ERRORS

    def readinto(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        """Read into ``bufs`` in turn from ``offset`` (one ``preadv``); bytes read."""
        return os.preadv(fd, bufs, offset)

    def set_direct(self, fd: int) -> None:
        """Read ``fd`` past the page cache from now on (``O_DIRECT``); OSError (EINVAL)
        where its filesystem takes none."""
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)

    def punch_hole(self, fd: int, offset: int, length: int) -> bool:
        """Free the blocks of a byte range (``durability.punch_hole``); False if the
        filesystem cannot."""
        return durability.punch_hole(fd, offset, length)

    def truncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def rename(self, src: str, dst: str, src_dir_fd: int, dst_dir_fd: int) -> None:
        os.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    def unlink(self, name: str, dir_fd: int) -> None:
        os.unlink(name, dir_fd=dir_fd)

    def close(self, fd: int) -> None:
        os.close(fd)
