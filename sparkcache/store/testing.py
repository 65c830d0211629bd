"""Helpers for tests and benchmarks of the store: deterministic pages and injected faults."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from sparkcache.store import index
from sparkcache.store.fileops import FileOps
from sparkcache.store.layout import fanout, object_name, open_subdir
from sparkcache.store.objects import record_span, split_pieces
from sparkcache.store.records import PageData, Root

if TYPE_CHECKING:
    from sparkcache.store.store import PageStore


def page_bytes(key: str, size: int) -> bytes:
    """Deterministic page contents derived from the key, so any reader can check them."""
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def object_file(objects_dir: Path, conn: sqlite3.Connection, key: str) -> tuple[Path, int]:
    """The file holding page ``key``'s object (its own, or a pack) and the offset of its
    record there, as the index on ``conn`` names them."""
    generation, file_key, offset = conn.execute(
        "SELECT generation, file_key, file_offset FROM objects WHERE key = ?", (key,)).fetchone()
    name_key = file_key or key
    return objects_dir / fanout(name_key) / object_name(name_key, generation), offset


def drop_from_page_cache(paths: Iterable[Path]) -> None:
    """Write back everything dirty, then drop ``paths`` from the page cache (``DONTNEED``
    passes over dirty pages, hence the sync first): the next read of them is a cold one.
    Does nothing on a filesystem in memory."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def evict_from_page_cache(store_dir: Path, rank: int = 0) -> None:
    """Every object file of ``rank``'s store out of the page cache
    (``drop_from_page_cache``)."""
    objects = Path(store_dir) / f"rank-{rank}" / "objects"
    drop_from_page_cache(p for p in objects.rglob("*.*") if p.is_file())


def make_root(root_id: str, keys: list[str], size: int) -> Root:
    return Root(root_id, [PageData(k, page_bytes(k, size)) for k in keys])


class FaultyFileOps(FileOps):
    """FileOps that fails like a full disk or a dying device, on demand.

    ``space``: bytes that may still be written before ``write`` raises ENOSPC (None:
    unlimited). ``fail_sync``: make every ``fsync`` and ``sync_filesystem`` raise EIO.
    ``per_file_sync``: act as a kernel whose syncfs reports no writeback error (before
    Linux 5.8), so a commit fsyncs each file. Counts the calls that wait for the disk.
    """

    def __init__(
        self, space: int | None = None, fail_sync: bool = False, per_file_sync: bool = False
    ) -> None:
        self.space = space
        self.fail_sync = fail_sync
        self.per_file_sync = per_file_sync
        self.fsyncs = 0  # of files and directories alike
        self.filesystem_syncs = 0

    def write(self, fd: int, pieces: list[memoryview]) -> int:
        if self.space is not None:
            if self.space <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            pieces = split_pieces(pieces, self.space)[0]
        n = super().write(fd, pieces)
        if self.space is not None:
            self.space -= n
        return n

    def fsync(self, fd: int) -> None:
        self.fsyncs += 1
        if self.fail_sync:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        super().fsync(fd)

    def sync_filesystem(self, fd: int) -> None:
        self.filesystem_syncs += 1
        if self.fail_sync:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        super().sync_filesystem(fd)

    @property
    def syncfs_reports_errors(self) -> bool:
        return not self.per_file_sync and super().syncfs_reports_errors


class KillAt:
    """A step hook that SIGKILLs its own process the ``nth`` time it reaches ``step``.

    Occurrences count only while ``armed``, so a caller can let some operations finish
    (and be acknowledged) before the kill.
    """

    def __init__(self, step: str, nth: int, armed: bool = True) -> None:
        self.step = step
        self.nth = nth
        self.armed = armed
        self.seen = 0

    def __call__(self, step: str) -> None:
        if step == self.step and self.armed:
            self.seen += 1
            if self.seen == self.nth:
                os.kill(os.getpid(), signal.SIGKILL)


def populate(store_conn: sqlite3.Connection, roots: int, pages: int, page_bytes: int,
             now: float) -> None:
    """Fill an empty index with ``roots`` roots of ``pages`` pages each (their own objects,
    refcount 1, no files), in SQL alone: a million roots in seconds where commits would
    take hours. Last accesses are one second apart up to ``now``, in the order of the
    ids (so every index is filled by appends), and leases have ended, so every root is a
    victim. Row for row what commits leave (fsck would only miss the files), so eviction
    and collection run as on a real store; a collected object's missing file is ignored,
    as after a crash."""
    with index.write_txn(store_conn) as conn:
        conn.execute(
            "CREATE TEMP TABLE seq AS WITH RECURSIVE s(i) AS "
            "(SELECT 0 UNION ALL SELECT i + 1 FROM s WHERE i + 1 < ?) SELECT i FROM s",
            (roots * pages,),
        )
        # Keys and ids as 32 hex digits, in order, so that b-tree inserts are appends.
        conn.execute(
            "INSERT INTO objects SELECT printf('%032x', i), '0000000000000000', ?, 1, "
            "'live', ?, NULL, 0, NULL FROM seq", (page_bytes, now))
        conn.execute(
            "INSERT INTO roots SELECT printf('%032x', i), ?, ?, ?, a, a FROM "
            "(SELECT i, ? - ? + i AS a FROM seq WHERE i < ?)",
            (pages * page_bytes, pages, now, now, roots, roots))
        conn.execute(
            "INSERT INTO root_pages SELECT printf('%032x', i / ?), i % ?, printf('%032x', i) "
            "FROM seq", (pages, pages))
        conn.execute("DROP TABLE seq")


def populate_packs(store: PageStore, pages: int, page_bytes: int, pack_records: int,
                   root_pages: int, now: float) -> None:
    """Fill an empty store with ``pages`` pages in packs of ``pack_records`` records,
    roots of ``root_pages`` pages, in SQL and sparse files alone (``populate``, with the
    files a sweep looks for): ten million rows in minutes, a pack file of no blocks. Keys
    spread over the fan-out directories by pack. What ``scripts/bench_start.py`` starts
    a supervisor on; a restore of it reads zeros, which fail their checksum."""
    if pages % root_pages or pack_records % 16:
        raise ValueError(f"{pages} pages in roots of {root_pages} and packs of "
                         f"{pack_records}: whole roots, and packs of a multiple of 16")

    def key(i: str) -> str:
        """The key of record ``i`` (an SQL expression), as 32 hex digits: its pack's fan-out
        directory first, then a digit that spreads the rows, and the packs' names, over
        the sixteenths of a directory (units of the sweep after a start), as the hex
        digests of real keys are spread."""
        pack = f"({i}) / {pack_records}"
        return f"printf('%02x%x%029x', {pack} % 256, ({pack} / 256 + ({i})) % 16, {i})"

    first = key(f"(i / {pack_records}) * {pack_records}")
    with index.write_txn(store._wconn) as conn:
        conn.execute(
            "CREATE TEMP TABLE seq AS WITH RECURSIVE s(i) AS "
            "(SELECT 0 UNION ALL SELECT i + 1 FROM s WHERE i + 1 < ?) SELECT i FROM s",
            (pages,),
        )
        conn.execute(
            f"INSERT INTO objects SELECT {key('i')}, "
            f"'0000000000000000', ?, 1, 'live', ?, CASE WHEN i % {pack_records} = 0 "
            f"THEN NULL ELSE {first} END, (i % {pack_records}) * ?, NULL FROM seq",
            (page_bytes, now, record_span(page_bytes)))
        roots = pages // root_pages
        conn.execute(
            "INSERT INTO roots SELECT printf('%032x', i), ?, ?, ?, ? - ? + i, ? - ? + i "
            "FROM seq WHERE i < ?",
            (root_pages * page_bytes, root_pages, now, now, roots, now, roots, roots))
        conn.execute(
            f"INSERT INTO root_pages SELECT printf('%032x', i / ?), i % ?, "
            f"{key('i')} FROM seq", (root_pages, root_pages))
        conn.execute("DROP TABLE seq")
    for p in range(-(-pages // pack_records)):
        name = f"{p % 256:02x}{p // 256 % 16:x}{p * pack_records:029x}"
        fd = open_subdir(fanout(name), store._objects_fd, create=True)
        try:
            f = os.open(object_name(name, "0" * 16), os.O_CREAT | os.O_WRONLY, 0o600,
                        dir_fd=fd)
            os.ftruncate(f, min(pack_records, pages - p * pack_records)
                         * record_span(page_bytes))
            os.close(f)
        finally:
            os.close(fd)
