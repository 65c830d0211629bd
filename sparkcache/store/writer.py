"""Durably writing object files: step 2 of the commit protocol, and undoing it.

Each page goes to ``<key>.<generation>.tmp`` (its header checksummed ahead on a second
thread), its writeback is started at once (the disk writes it while the committer writes
the next) and it is closed; every temp file is renamed to its final name; then one
``syncfs`` makes all of them durable, data, inodes and directory entries alike. Only after
that may an index row name a file.

So a commit of P pages costs one filesystem sync, where it cost P file fsyncs and one
fsync per fan-out directory touched: each fsync was a device cache flush (most of them a
journal commit too), and P of them ran at a fraction of the disk's rate. A directory fsync
after the syncfs would add only flushes, and those were not free either: 256 of them took
11-268 ms after a 2 GiB commit here, the more the more other processes wrote.

Renaming before the sync is safe because no row names a file until the index transaction,
which comes after it: a crash (or power loss) before then leaves at most torn files under
temp names or under generations no row names, which ``reconcile`` removes.

A temp may be a pooled file (``store/pool.py``) renamed onto its name and overwritten
in place rather than a new one: the protocol is the same from there, and what a crash
leaves is the same too, a temp or an unnamed generation holding old bytes and new.

Where ``syncfs`` does not report writeback errors (Linux before 5.8) each file and then
each fan-out directory touched is fsynced instead, after all are written
(``FileOps.syncfs_reports_errors``).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass

from sparkcache.store.fileops import FileOps, StepHook
from sparkcache.store.layout import fanout, new_generation, object_name, open_subdir, temp_name
from sparkcache.store.objects import HEADER_SIZE, build_header, write_temp
from sparkcache.store.pool import FilePool

log = logging.getLogger(__name__)

_SYNC_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class WrittenFile:
    """A file this process wrote for a commit, under its temp or (once renamed) final name."""

    key: str
    generation: str
    renamed: bool = False


class ObjectWriter:
    """Writes and removes the object files of one rank's ``objects/`` directory."""

    def __init__(self, ops: FileOps, hook: StepHook, objects_fd: int,
                 pool: FilePool | None = None) -> None:
        self._ops = ops
        self._hook = hook
        self._free = pool  # pooled files to overwrite instead of creating temps
        # syncfs reports a writeback error once per open file description: this one is
        # the store's own, so no other caller can consume an error meant for a commit.
        self._objects_fd = objects_fd
        self._pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def write(
        self, keys: list[str], data: dict[str, list[memoryview]],
        written: dict[str, WrittenFile],
    ) -> None:
        """Write, rename and make durable the pages of ``keys``.

        Every file is entered in ``written`` before it is created, so on any exception the
        caller can ``discard`` exactly what exists. A failed sync is never retried: the
        state of the pages it could not write is unknown, so the commit fails.
        """
        if not keys:
            return
        # Grouped by fan-out directory, so each directory is opened once.
        by_dir: dict[str, list[str]] = {}
        for key in keys:
            by_dir.setdefault(fanout(key), []).append(key)
        fresh = [WrittenFile(k, new_generation()) for group in by_dir.values() for k in group]
        # Checksums are a CPU cost of a commit (CRC-32C ~19 GB/s here): one thread
        # computes the headers ahead while this one writes; crc32c releases the GIL, so
        # the two overlap.
        pool = self._checksummer()
        headers = [pool.submit(build_header, w.key, w.generation, data[w.key]) for w in fresh]
        dir_fds: dict[str, int] = {}
        try:
            for fan in by_dir:
                dir_fds[fan] = open_subdir(fan, self._objects_fd, create=True)
            if self._free is not None:
                self._free.refill()
            for w, header in zip(fresh, headers, strict=True):
                written[w.key] = w
                dir_fd = dir_fds[fanout(w.key)]
                recycled = None
                if self._free is not None:
                    size = HEADER_SIZE + sum(p.nbytes for p in data[w.key])
                    recycled = self._free.take(size, temp_name(w.key, w.generation), dir_fd)
                fd = write_temp(
                    self._ops, dir_fd, w.key, w.generation, header.result(), data[w.key],
                    self._hook, recycled,
                )
                try:
                    self._ops.start_writeback(fd)
                finally:
                    self._ops.close(fd)
                self._hook("commit.written")
            for w in fresh:
                fd = dir_fds[fanout(w.key)]
                self._ops.rename(
                    temp_name(w.key, w.generation), object_name(w.key, w.generation), fd, fd
                )
                w.renamed = True
                self._hook("commit.rename")
            self._make_durable(fresh, dir_fds)
            self._hook("commit.durable")
        finally:
            # After a failure no checksum may still be reading the caller's pages.
            for header in headers:
                header.cancel()
            futures_wait(headers)
            for fd in dir_fds.values():
                os.close(fd)

    def _checksummer(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="sparkcache-crc")
        return self._pool

    def _make_durable(self, files: list[WrittenFile], dir_fds: dict[str, int]) -> None:
        """Make ``files`` and their names durable: one ``syncfs`` (``sync(2)``: "all
        pending modifications to filesystem metadata and cached file data"). Where syncfs
        would not report a page it failed to write, an fsync of each file and then of each
        directory instead."""
        if self._ops.syncfs_reports_errors:
            self._ops.sync_filesystem(self._objects_fd)
            return
        for w in files:
            name = object_name(w.key, w.generation)
            try:
                fd = self._ops.open(name, _SYNC_FLAGS, 0, dir_fds[fanout(w.key)])
            except FileNotFoundError:
                continue  # swept by a concurrent reconcile: the index transaction sees it
            try:
                self._ops.fsync(fd)
            finally:
                self._ops.close(fd)
        for fd in dir_fds.values():
            self._ops.fsync(fd)

    def exists(self, w: WrittenFile) -> bool:
        """Whether ``w``'s final file is still in place as a regular file."""
        try:
            fd = open_subdir(fanout(w.key), self._objects_fd, create=False)
        except FileNotFoundError:
            return False
        try:
            st = os.stat(object_name(w.key, w.generation), dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        finally:
            os.close(fd)
        return stat.S_ISREG(st.st_mode)

    def discard(self, files: Iterable[WrittenFile]) -> None:
        """Unlink files that no index row references (their own generation only)."""
        for w in list(files):
            name = (object_name if w.renamed else temp_name)(w.key, w.generation)
            try:
                fd = open_subdir(fanout(w.key), self._objects_fd, create=False)
            except FileNotFoundError:
                continue
            try:
                self._ops.unlink(name, fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                # Left for reconcile(): an unreferenced file is an orphan, never data.
                log.warning("could not remove unreferenced %s: %s", name, exc)
            finally:
                os.close(fd)
