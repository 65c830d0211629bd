"""The store's filesystem running out of space: telling a full disk from other faults,
and how much room is left (docs/store.md, "A full disk").

A full filesystem is not a fault of the store's environment that a restart cannot mend,
as an unusable directory is: space comes back when maintenance evicts, when an operator
deletes something, or when another tenant of the disk does. So the workers that meet it
stay up, count it, and try again; the free-space reserve (``min_free_bytes``) keeps the
store itself from being what fills the disk.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
from dataclasses import dataclass

from sparkcache.store.layout import BALLAST_NAME, FILE_FLAGS, FILE_MODE
from sparkcache.store.records import causes

log = logging.getLogger(__name__)

# The most a ballast holds: eviction's index writes up to a checkpoint (the WAL is cut
# back to 64 MiB after each, index.WAL_SIZE_LIMIT).
BALLAST_MAX_BYTES = 64 << 20
# SQLite's result code for "database or disk is full" (sqlite3.h).
_SQLITE_FULL = 13
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an exception it was raised from or during, is a full
    filesystem or quota: ``ENOSPC``/``EDQUOT`` from the kernel, or SQLite's
    ``SQLITE_FULL`` (a COMMIT that found no room for its WAL frames)."""
    return any(
        (isinstance(e, OSError) and e.errno in _FULL_ERRNOS)
        or (isinstance(e, sqlite3.Error) and (
            getattr(e, "sqlite_errorcode", None) == _SQLITE_FULL
            or "database or disk is full" in str(e)))
        for e in causes(exc))


@dataclass(frozen=True)
class Space:
    """A filesystem's size and the bytes an unprivileged writer may still use."""

    total_bytes: int
    free_bytes: int


def space_of(fd: int) -> Space:
    """The filesystem holding open directory ``fd`` (``f_bavail``: what is left to users
    other than root, the conservative figure)."""
    st = os.fstatvfs(fd)
    return Space(st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)


def reserve_shortfall(space: Space, min_free_bytes: int, ranks: int) -> int:
    """Bytes one rank's maintenance evicts for the filesystem to regain
    ``min_free_bytes`` free: its share of what is missing (every rank of the node sees
    the same filesystem, and each evicts its part), 0 when the reserve holds."""
    missing = min_free_bytes - space.free_bytes
    return 0 if missing <= 0 else -(-missing // max(1, ranks))


def ballast_bytes(min_free_bytes: int) -> int:
    """The ballast kept with a free-space reserve of ``min_free_bytes``: a quarter of it,
    at most ``BALLAST_MAX_BYTES``; none without a reserve."""
    return min(BALLAST_MAX_BYTES, max(0, min_free_bytes) // 4)


class Ballast:
    """A file of preallocated blocks in the rank's directory, held by maintenance and
    given up when the index finds no room (CockroachDB keeps an emergency ballast for the
    same reason). On a disk another file filled, evicting needs index writes, and
    SQLite's WAL may need new blocks for them: without room, eviction failed at every
    COMMIT and nothing was ever freed. Given up, its blocks let the next slice commit;
    taken again once the reserve holds with room for it."""

    def __init__(self, rank_dir_fd: int, size: int) -> None:
        self._dir_fd = rank_dir_fd
        self.size = size

    @property
    def present(self) -> bool:
        try:
            os.stat(BALLAST_NAME, dir_fd=self._dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def take(self) -> bool:
        """Create it, its blocks allocated; False if there is no room (nothing left)."""
        try:
            fd = os.open(BALLAST_NAME, os.O_WRONLY | os.O_CREAT | FILE_FLAGS, FILE_MODE,
                         dir_fd=self._dir_fd)
        except OSError as exc:
            log.warning("could not create the ballast: %s", exc)
            return False
        try:
            os.posix_fallocate(fd, 0, self.size)
            return True
        except OSError as exc:
            if exc.errno not in _FULL_ERRNOS:
                log.warning("could not allocate the ballast: %s", exc)
            os.unlink(BALLAST_NAME, dir_fd=self._dir_fd)
            return False
        finally:
            os.close(fd)

    def release(self) -> bool:
        """Unlink it; whether it was there."""
        try:
            os.unlink(BALLAST_NAME, dir_fd=self._dir_fd)
        except FileNotFoundError:
            return False
        log.warning("the store's filesystem is full: gave up the %d-byte ballast so that "
                    "eviction can commit", self.size)
        return True
