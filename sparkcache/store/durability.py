"""The Linux calls the store needs that ``os`` does not offer: two that make a commit's
files durable, and the one that frees a collected record's blocks inside a pack.

* ``start_writeback``: ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` submits a written file's
  dirty pages to the disk and returns without waiting, so the disk writes one page while
  the committer checksums the next, and little is left dirty when the commit syncs.
* ``sync_filesystem``: ``syncfs(2)`` writes back every dirty page and inode of the
  filesystem, waits for all of it, commits the journal and flushes the device cache: one
  call makes every file of a commit (and the renames) durable, however many there are.

* ``punch_hole``: ``fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)`` frees the
  blocks of a byte range of a file, which then reads as zeros, its size unchanged.

``syncfs`` reports a writeback error (EIO, ENOSPC) to the descriptor it is called on only
since Linux 5.8 (``SYNCFS_REPORTS_ERRORS``); before that it returned 0 even when pages
could not be written, so it cannot stand for fsync there (``writer`` falls back to one
fsync per file). The error it reports may come from any file of the filesystem written
since the descriptor's last ``syncfs``: a commit can fail for another process's failed
write, never succeed over one of its own.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syncfs.argtypes = [ctypes.c_int]
_libc.syncfs.restype = ctypes.c_int
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
_libc.sync_file_range.restype = ctypes.c_int

_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_libc.fallocate.restype = ctypes.c_int

_SYNC_FILE_RANGE_WRITE = 2
_FALLOC_FL_KEEP_SIZE = 1
_FALLOC_FL_PUNCH_HOLE = 2
# sync_file_range is only a hint where the filesystem cannot do it: the sync still follows.
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.ESPIPE, errno.EOPNOTSUPP}


def kernel_version(release: str) -> tuple[int, int]:
    """``(major, minor)`` of a ``uname -r`` string such as ``6.8.0-45-generic``."""
    match = re.match(r"(\d+)\.(\d+)", release)
    if match is None:
        return (0, 0)
    return (int(match.group(1)), int(match.group(2)))


SYNCFS_REPORTS_ERRORS = kernel_version(os.uname().release) >= (5, 8)


def _raise_errno() -> None:
    code = ctypes.get_errno()
    raise OSError(code, os.strerror(code))


def sync_filesystem(fd: int) -> None:
    """``syncfs(fd)``: make everything written to ``fd``'s filesystem durable; raise
    OSError if the kernel reports that anything could not be written."""
    if _libc.syncfs(fd) != 0:
        _raise_errno()


def start_writeback(fd: int, offset: int = 0, nbytes: int = 0) -> None:
    """Submit the dirty pages of ``nbytes`` at ``offset`` of ``fd`` (0: to the end) to the
    disk without waiting for them (a head start for the sync that follows, never a
    substitute). Only the range just written: asked for the whole file each time, the
    kernel walks every page written before it again. A filesystem that cannot is no
    error; an I/O error is raised."""
    failed = _libc.sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) != 0
    if failed and ctypes.get_errno() not in _UNSUPPORTED:
        _raise_errno()


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Free the blocks of ``length`` bytes at ``offset`` of ``fd`` (whole blocks inside the
    range; the partial ones at its ends are zeroed and kept). False where the filesystem
    cannot (the bytes then stay allocated until the whole file is removed); an I/O error
    is raised."""
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        return True
    if ctypes.get_errno() in _UNSUPPORTED:
        return False
    _raise_errno()
    return False
