"""Durably writing object files and packs: step 2 of the commit protocol, and undoing it.

The new pages of a commit go to one file, ``<key>.<generation>.tmp`` named after the first
of them: the object of a single page, or a pack of one record per page (docs/store.md,
"Packs"). Each record's header is checksummed ahead on a second thread, its writeback
started as soon as it is written (the disk writes it while the committer writes the next);
the file is renamed to its final name; then one ``syncfs`` for every file of a batch of
publications (``start_durable``, on the sync thread) makes them durable, data, inode and
directory entry alike. Only after that may an index row naming them commit.

So a commit of P pages costs one file and one filesystem sync, where it once cost P files,
P file fsyncs and one fsync per fan-out directory touched: each fsync was a device cache
flush (most of them a journal commit too), and P of them ran at a fraction of the disk's
rate. A directory fsync after the syncfs would add only flushes, and those were not free
either: 256 of them took 11-268 ms after a 2 GiB commit here, the more the more other
processes wrote.

Renaming before the sync is safe because no row names a file until the index transaction,
which comes after it: a crash (or power loss) before then leaves at most a torn file, a temp
or a file no row names, which ``reconcile`` removes.

A temp may be a pooled file (``store/pool.py``) renamed onto its name and overwritten
in place rather than a new one: the protocol is the same from there, and what a crash
leaves is the same too, a temp or an unnamed generation holding old bytes and new.

Where ``syncfs`` does not report writeback errors (Linux before 5.8) the file and then its
fan-out directory are fsynced instead (``FileOps.syncfs_reports_errors``).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from functools import partial

from sparkcache.store.fileops import FileOps, StepHook
from sparkcache.store.layout import fanout, new_generation, object_name, open_subdir, temp_name
from sparkcache.store.objects import (
    HEADER_SIZE,
    Record,
    build_header,
    record_span,
    write_temp,
)
from sparkcache.store.pool import FilePool

log = logging.getLogger(__name__)

_SYNC_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_PUNCH_FLAGS = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


# Pages whose headers one task of the checksum thread builds.
HEADER_BATCH = 64


def _build_headers(keys: list[str], generation: str,
                   payloads: list[list[memoryview]]) -> list[bytes]:
    return [build_header(k, generation, p) for k, p in zip(keys, payloads, strict=True)]


def _nth_header(batch: Future, n: int) -> bytes:
    return batch.result()[n]


@dataclass(eq=False)
class WrittenFile:
    """A file this process wrote for a commit, under its temp or (once renamed) final name:
    one page's object, or a pack of several pages' records (``packed``), named after its
    first record's key."""

    key: str
    generation: str
    # page key -> (offset, bytes) of its record: the whole file for one page
    records: dict[str, tuple[int, int]] = field(default_factory=dict)
    packed: bool = False
    renamed: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of its records."""
        return sum(n for _, n in self.records.values())


class ObjectWriter:
    """Writes and removes the object files and packs of one rank's ``objects/`` directory."""

    def __init__(self, ops: FileOps, hook: StepHook, objects_fd: int,
                 pool: FilePool | None = None) -> None:
        self._ops = ops
        self._hook = hook
        self._free = pool  # pooled files to overwrite instead of creating temps
        # syncfs reports a writeback error once per open file description: this one is
        # the store's own, so no other caller can consume an error meant for a commit.
        self._objects_fd = objects_fd
        self._pool: ThreadPoolExecutor | None = None
        self._syncer: ThreadPoolExecutor | None = None

    def close(self) -> None:
        for pool in (self._pool, self._syncer):
            if pool is not None:
                pool.shutdown()
        self._pool = self._syncer = None

    def write(
        self, keys: list[str], data: dict[str, list[memoryview]],
        written: dict[str, WrittenFile],
    ) -> WrittenFile | None:
        """Write and rename the pages of ``keys``: one object file for one page, one pack
        for more (their records in the order of ``keys``); None if there are none. Not
        durable until ``start_durable``.

        Every key is entered in ``written`` before its file is created, so on any
        exception the caller can ``discard`` exactly what exists.
        """
        if not keys:
            return None
        file = WrittenFile(keys[0], new_generation(), packed=len(keys) > 1)
        # Checksums are a CPU cost of a commit (CRC-32C ~19 GB/s here): one thread
        # computes the headers ahead while this one writes; crc32c releases the GIL, so
        # the two overlap. HEADER_BATCH at a time: a task per page cost ~25 us each.
        pool = self._checksummer()
        headers = [pool.submit(_build_headers, keys[i:i + HEADER_BATCH], file.generation,
                               [data[k] for k in keys[i:i + HEADER_BATCH]])
                   for i in range(0, len(keys), HEADER_BATCH)]
        records = []
        for i, key in enumerate(keys):
            header = partial(_nth_header, headers[i // HEADER_BATCH], i % HEADER_BATCH)
            payload = sum(p.nbytes for p in data[key])
            padding = record_span(payload) - HEADER_SIZE - payload if file.packed else 0
            records.append(Record(header, data[key], padding))
        at = 0
        for key, record in zip(keys, records, strict=True):
            file.records[key] = (at, record.size)
            at += record.size
        dir_fd = -1
        try:
            dir_fd = open_subdir(fanout(file.key), self._objects_fd, create=True)
            recycled = None
            if self._free is not None:
                self._free.refill()
                recycled = self._free.take(at, temp_name(file.key, file.generation), dir_fd)
            for key in keys:
                written[key] = file
            fd = write_temp(self._ops, dir_fd, file.key, file.generation, records,
                            self._hook, recycled)
            self._ops.close(fd)
            name = object_name(file.key, file.generation)
            self._ops.rename(temp_name(file.key, file.generation), name, dir_fd, dir_fd)
            file.renamed = True
            self._hook("commit.rename")
        finally:
            # After a failure no checksum may still be reading the caller's pages.
            for header in headers:
                header.cancel()
            futures_wait(headers)
            if dir_fd >= 0:
                os.close(dir_fd)
        return file

    def _checksummer(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="sparkcache-crc")
        return self._pool

    def start_durable(self, files: list[WrittenFile]) -> Future:
        """``_make_durable(files)`` on the sync thread: its future (its result None, or
        the sync's error)."""
        if self._syncer is None:
            self._syncer = ThreadPoolExecutor(1, thread_name_prefix="sparkcache-sync")
        return self._syncer.submit(self._make_durable, files)

    def _make_durable(self, files: list[WrittenFile]) -> None:
        """Make ``files`` and their names durable: one ``syncfs`` (``sync(2)``: "all
        pending modifications to filesystem metadata and cached file data") however many
        there are. Where syncfs would not report a page it failed to write, an fsync of
        each file and of its directory instead. A failed sync is never retried: the state
        of the pages it could not write is unknown, so the commit fails."""
        if not files:
            return
        if self._ops.syncfs_reports_errors:
            self._ops.sync_filesystem(self._objects_fd)
        else:
            for file in files:
                self._fsync_one(file)

    def _fsync_one(self, file: WrittenFile) -> None:
        try:
            dir_fd = open_subdir(fanout(file.key), self._objects_fd, create=False)
        except FileNotFoundError:
            return  # swept by a concurrent reconcile: the index transaction sees it
        try:
            try:
                fd = self._ops.open(object_name(file.key, file.generation), _SYNC_FLAGS, 0,
                                    dir_fd)
            except FileNotFoundError:
                return  # swept by a concurrent reconcile: the index transaction sees it
            try:
                self._ops.fsync(fd)
            finally:
                self._ops.close(fd)
            self._ops.fsync(dir_fd)
        finally:
            os.close(dir_fd)

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
        for w in {id(f): f for f in files}.values():
            self.unlink(w.key, w.generation, renamed=w.renamed)

    def release(self, keys: Iterable[str], written: dict[str, WrittenFile]) -> None:
        """Take the records of ``keys`` out of the files that hold them (``written``),
        which no row names: a file left with none is unlinked, a pack that keeps others
        has their bytes punched out. ``written`` loses those keys."""
        files: dict[int, tuple[WrittenFile, list[str]]] = {}
        for key in keys:
            w = written.pop(key)
            files.setdefault(id(w), (w, []))[1].append(key)
        for w, gone in files.values():
            if any(written.get(k) is w for k in w.records):
                for key in gone:
                    self.punch(w.key, w.generation, *w.records[key])
            else:
                self.unlink(w.key, w.generation, renamed=w.renamed)

    def unlink(self, key: str, generation: str, renamed: bool = True) -> None:
        """Unlink file ``key.generation`` (or its temp), which no row names; a file
        already gone is no error."""
        name = (object_name if renamed else temp_name)(key, generation)
        try:
            fd = open_subdir(fanout(key), self._objects_fd, create=False)
        except FileNotFoundError:
            return
        try:
            self._ops.unlink(name, fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            # Left for reconcile(): an unreferenced file is an orphan, never data.
            log.warning("could not remove unreferenced %s: %s", name, exc)
        finally:
            os.close(fd)

    def shrink(self, key: str, generation: str, step: int) -> int:
        """Free the last ``step`` bytes of file ``key.generation``, which no row names,
        or unlink it once it is no longer than that; the bytes it still holds (0: gone).
        A file already gone, or one that cannot be truncated, is unlinked or left for
        ``reconcile()`` as an orphan."""
        try:
            dir_fd = open_subdir(fanout(key), self._objects_fd, create=False)
        except FileNotFoundError:
            return 0
        try:
            name = object_name(key, generation)
            fd = self._ops.open(name, _PUNCH_FLAGS, 0, dir_fd)
            try:
                size = os.fstat(fd).st_size
                if size > step:
                    self._ops.truncate(fd, size - step)
                    self._hook("collect.shrunk")
                    return size - step
            finally:
                self._ops.close(fd)
            self._ops.unlink(name, dir_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove unreferenced %s.%s: %s", key, generation, exc)
        finally:
            os.close(dir_fd)
        return 0

    def punch(self, key: str, generation: str, offset: int, length: int) -> None:
        """Free the blocks of the record at ``offset`` (``length`` bytes) of pack
        ``key.generation``, which no row names any more. A pack already gone is no
        error; one that cannot be punched keeps the bytes until the pack goes."""
        try:
            dir_fd = open_subdir(fanout(key), self._objects_fd, create=False)
        except FileNotFoundError:
            return
        try:
            fd = self._ops.open(object_name(key, generation), _PUNCH_FLAGS, 0, dir_fd)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("could not open pack %s.%s to free a record: %s", key, generation, exc)
            return
        finally:
            os.close(dir_fd)
        try:
            if not self._ops.punch_hole(fd, offset, length):
                log.warning("this filesystem cannot free part of a file: pack %s.%s keeps "
                            "%d bytes until it is removed", key, generation, length)
        except OSError as exc:
            log.warning("could not free a record of pack %s.%s: %s", key, generation, exc)
        finally:
            self._ops.close(fd)
