"""Collected object files kept for the next commits to overwrite: ``rank-<r>/free/``.

At a store's cap every commit creates files while maintenance frees as many of the same
size, and on ext4 that pairing, not the inventory or maintenance's CPU, is what made
commits at the cap 2-3x slower than into an empty store (docs/maintenance.md, "Recycled
files: what slowed a commit at the cap"). So collection renames a collected object's file
into this directory instead of unlinking it, while the pool holds less than its cap, and
a commit renames a pooled file onto its temp name and overwrites it in place: no inode or
extent is allocated or freed, and the blocks are already there.

A pooled file is named ``<size>.<random>`` (16 hex digits each): its size, so that the
pool's bytes are known from a listing, and a name that never parses as an object's, so no
reader ever opens one. Its bytes are an old object's; they reach an object name only
after being overwritten and made durable, as a fresh temp's do (docs/store.md, "Recycled
files").

Two processes share the directory: maintenance only adds to it (``put``), commit only
takes from it (``take``). Nothing else writes there; a name that is not a pooled file's is
never touched.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
import time
from collections.abc import Callable

from sparkcache.store.fileops import FileOps

_FREE_RE = re.compile(r"(?P<size>[0-9a-f]{16})\.[0-9a-f]{16}")
# Only maintenance adds files, so between listings its figure of the pool can only be too
# high (commits took some since): it lists the pool again when the figure says full, at
# most this often. Commits drain the pool at the rate they publish (~250 files a second in
# bench_maintenance), so a figure read once a second is out by up to a second of that.
REFRESH_S = 0.05
_REUSE_FLAGS = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def free_name(size: int) -> str:
    return f"{size:016x}.{secrets.token_hex(8)}"


def parse_free_name(name: str) -> int | None:
    """The size a pooled file's name carries, or None for any other name."""
    m = _FREE_RE.fullmatch(name)
    return None if m is None else int(m["size"], 16)


class FilePool:
    """One rank's pool of free object files, as seen by one process."""

    def __init__(self, ops: FileOps, free_fd: int, cap_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ops = ops
        self._fd = free_fd
        self.cap_bytes = cap_bytes  # what ``put`` may pool; 0: nothing (``take`` still takes)
        # Set by maintenance while the filesystem is short of its free-space reserve: a
        # pooled file holds the disk space the reserve is for (``release``).
        self.suspended = False
        self._clock = clock
        self._pooled = 0  # bytes, as maintenance last read them plus what it added since
        self._read_at = float("-inf")
        self._names: dict[int, list[str]] = {}  # commit's listing: size -> names
        self.pooled_files = 0  # by this process: put
        self.taken_files = 0  # by this process: take

    # ------------------------------------------------------------------ maintenance

    def put(self, name: str, dir_fd: int, size: int) -> bool:
        """Move the collected file ``name`` (under ``dir_fd``, ``size`` bytes) into the
        pool; False (nothing done) if that would take the pool past its cap."""
        if self.cap_bytes <= 0 or self.suspended:
            return False
        stale = self._read_at == float("-inf") or self._pooled + size > self.cap_bytes
        if stale and (now := self._clock()) - self._read_at >= REFRESH_S:
            self._pooled = self.pooled_bytes()
            self._read_at = now
        if self._pooled + size > self.cap_bytes:
            return False
        self._ops.rename(name, free_name(size), dir_fd, self._fd)
        self._pooled += size
        self.pooled_files += 1
        return True

    def release(self, nbytes: int) -> int:
        """Unlink pooled files until ``nbytes`` are freed or none is left; the bytes freed.
        For a filesystem short of its free-space reserve: the pool's files are space
        kept for speed, given back before eviction takes anything stored."""
        freed = 0
        for name in os.listdir(self._fd):
            if freed >= nbytes:
                break
            size = parse_free_name(name)
            if size is None:
                continue
            try:
                self._ops.unlink(name, self._fd)
            except FileNotFoundError:
                continue  # a commit took it
            freed += size
        self._pooled = max(0, self._pooled - freed)
        return freed

    def pooled_bytes(self) -> int:
        """Bytes of the pooled files, from one listing."""
        return sum(size for name in os.listdir(self._fd)
                   if (size := parse_free_name(name)) is not None)

    # ------------------------------------------------------------------ commit

    def refill(self) -> None:
        """List the pool again if every file of the last listing has been taken (once per
        commit: ``take`` never lists)."""
        if any(self._names.values()):
            return
        names: dict[int, list[str]] = {}
        for name in os.listdir(self._fd):
            size = parse_free_name(name)
            if size is not None:
                names.setdefault(size, []).append(name)
        self._names = names

    def take(self, size: int, dst: str, dst_dir_fd: int) -> int | None:
        """Rename a pooled file onto ``dst`` (under ``dst_dir_fd``) and return it open for
        writing, its times renewed, so that it is a fresh temp from the moment it has that
        name (recovery spares temps by their age). One of exactly ``size`` bytes if there
        is one, else any: the caller truncates it to its size once written. None if the
        pool (as last listed) is empty."""
        while True:
            name = self._pick(size)
            if name is None:
                return None
            try:
                fd = self._ops.open(name, _REUSE_FLAGS, 0, self._fd)
            except OSError:  # gone, or not a plain file: try the next
                continue
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    self._ops.close(fd)
                    continue
                os.utime(fd)
                self._ops.rename(name, dst, self._fd, dst_dir_fd)
            except FileNotFoundError:
                self._ops.close(fd)
                continue
            except BaseException:
                self._ops.close(fd)
                raise
            self.taken_files += 1
            return fd

    def _pick(self, size: int) -> str | None:
        names = self._names.get(size)
        if not names:
            names = next((v for v in self._names.values() if v), None)
        return names.pop() if names else None

