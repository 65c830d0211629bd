"""Reconciliation after a crash: repair index rows, then sweep ``objects/`` against them.

Safe to run while other processes commit or collect: every decision about a file is taken
inside a write transaction (one per fan-out directory, listed just before it) that reads
the rows of exactly that directory, and a commit checks, inside its own write
transaction, that the files it is about to reference still exist. The SQLite write lock
serialises the two, so reconcile never removes a file a committed row names, and a commit
never names a removed file. Temporary files are only removed after ``grace_seconds``, so
an in-flight commit's temp file is left alone; if it is removed anyway, that commit fails
cleanly.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sparkcache.store import index
from sparkcache.store.fileops import FileOps
from sparkcache.store.layout import is_fanout, object_name, open_subdir, parse_object_name
from sparkcache.store.objects import record_span
from sparkcache.store.records import StoreError

log = logging.getLogger(__name__)

_HEX = frozenset("0123456789abcdef")

# Punching frees whole blocks only; 4 KiB is the block of every filesystem the store runs
# on (ext4, XFS, btrfs), and a pack's records are aligned to it (``RECORD_ALIGN``).
BLOCK = 4096
_PUNCH_FLAGS = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


@dataclass
class SweepResult:
    temp_files_removed: int = 0
    orphan_files_removed: int = 0
    pack_ranges_freed: int = 0  # dead records of live packs whose blocks were still there
    # (key, generation) of live rows whose file is gone: the caller quarantines them.
    missing: tuple[tuple[str, str], ...] = ()


def check_readable(conn: sqlite3.Connection, where: str) -> None:
    """Fail closed: raise unless the index passes ``quick_check``."""
    try:
        check = [r[0] for r in conn.execute("PRAGMA quick_check")]
    except sqlite3.DatabaseError as exc:
        raise StoreError(f"index {where} cannot be read: {exc}") from exc
    if check != ["ok"]:
        raise StoreError(f"index {where} is damaged: {check[:5]}")


def repair_rows(conn: sqlite3.Connection) -> tuple[int, int]:
    """Remove dead rows and recompute refcounts in one transaction: (dead rows, fixed)."""
    with index.write_txn(conn):
        dead = conn.execute(
            "DELETE FROM root_pages WHERE root_id NOT IN (SELECT id FROM roots)"
        ).rowcount
        # A root naming an object without a row cannot be restored whole; only damage
        # from outside the protocol can cause it.
        dead += conn.execute(
            "DELETE FROM roots WHERE id IN (SELECT rp.root_id FROM root_pages rp "
            "LEFT JOIN objects o ON o.key = rp.key WHERE o.key IS NULL)"
        ).rowcount
        conn.execute("DELETE FROM root_pages WHERE root_id NOT IN (SELECT id FROM roots)")
        fixed = conn.execute(
            "UPDATE objects SET refcount = (SELECT count(*) FROM root_pages rp "
            "WHERE rp.key = objects.key) WHERE refcount != (SELECT count(*) "
            "FROM root_pages rp WHERE rp.key = objects.key)"
        ).rowcount
    return dead, fixed


def _prefix_range(prefix: str) -> tuple[str, str]:
    """Keys starting with the hex digits ``prefix`` sort in ``[prefix, next)``."""
    upper = int(prefix, 16) + 1
    return prefix, f"{upper:0{len(prefix)}x}" if upper < 16 ** len(prefix) else "g"


def sweep_units(digits: int) -> list[str]:
    """Every key prefix of ``digits`` hex digits (at least 2: a fan-out directory, or a
    part of one), in order: units of a sweep that together cover the store."""
    if digits < 2:
        raise ValueError(f"a sweep unit is a fan-out directory or a part of one: {digits}")
    return [f"{i:0{digits}x}" for i in range(16 ** digits)]


def sweep_files(
    conn: sqlite3.Connection, ops: FileOps, objects_fd: int, grace_seconds: float,
    units: Iterable[str] | None, sync_index: Callable[[], None],
) -> SweepResult:
    """Remove old temp files and files no row names; report live rows with no file. In
    the files whose names begin with one of the key prefixes ``units`` alone if given
    (``sweep_units``: each a fan-out directory's two digits, or more, for a part of
    one: the rows read and the write lock's hold shrink with it), else in every entry of
    ``objects/``.

    ``sync_index`` makes every committed transaction of the index durable
    (``index.sync_wal``): it runs once, before the first file no row names is unlinked
    or dead range of a pack punched. Those are unnamed because rows were deleted, and
    collection deletes rows in transactions it syncs only after the slice
    (``PageStore.collect``): a slice that raised before its sync, or a maintenance killed
    before it whose successor committed nothing synced, leaves deletions a power cut
    would undo. Freed before they were durable, the rows they bring back would name
    nothing or zeros: misses, not wrong bytes, but against the store's rule that bytes
    go only once their rows' deletion is durable."""
    result = SweepResult()
    missing: list[tuple[str, str]] = []
    synced = False

    def durable() -> None:
        nonlocal synced
        if not synced:
            sync_index()
            synced = True

    for unit in sorted(os.listdir(objects_fd)) if units is None else units:
        fan = unit[:2]
        if not (is_fanout(unit) if units is None else is_fanout(fan) and set(unit) <= _HEX):
            log.warning("unexpected entry objects/%s left in place", unit)
            continue
        try:
            fd = open_subdir(fan, objects_fd, create=False)
        except FileNotFoundError:
            continue  # nothing was ever stored under this prefix
        except (StoreError, OSError) as exc:
            log.warning("skipping objects/%s: %s", fan, exc)
            continue
        try:
            missing += _sweep_dir(conn, ops, fd, unit, grace_seconds, result, durable)
        finally:
            os.close(fd)
    result.missing = tuple(missing)
    return result


@dataclass(frozen=True)
class _Entry:
    """One file of a fan-out directory as listed, before any row was read."""

    name: str
    key: str
    generation: str
    is_temp: bool
    is_regular: bool
    old: bool  # older than the grace when listed


def _list_dir(fd: int, unit: str, grace_seconds: float) -> list[_Entry]:
    """The files of fan-out directory ``fd`` whose names begin with ``unit``. A name
    that is not the store's is reported by the unit that begins the directory."""
    entries = []
    now = time.time()
    fan = unit[:2]
    first = unit == fan.ljust(len(unit), "0")
    for name in os.listdir(fd):
        if not name.startswith(unit):
            if first and not (name.startswith(fan) and parse_object_name(name)):
                log.warning("unexpected entry objects/%s/%s left in place", fan, name)
            continue
        parsed = parse_object_name(name)
        if parsed is None:
            if first:
                log.warning("unexpected entry objects/%s/%s left in place", fan, name)
            continue
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # collected since the listing
        key, generation, is_temp = parsed
        entries.append(_Entry(name, key, generation, is_temp, stat.S_ISREG(st.st_mode),
                              now - st.st_mtime >= grace_seconds))
    return entries


def _sweep_dir(
    conn: sqlite3.Connection,
    ops: FileOps,
    fd: int,
    unit: str,
    grace_seconds: float,
    result: SweepResult,
    durable: Callable[[], None],
) -> list[tuple[str, str]]:
    """The files of one fan-out directory (``fd``) under key prefix ``unit``. Its files
    are object files named by their own key's row and packs named by the rows of their
    records (``file_key``), whatever directories those records' own keys fall in.

    The directory is listed and its files stat-ed before the write transaction, so a
    commit waits for the rows of one directory to be read and its orphans removed, not
    for a directory of cold inodes to be read from disk. What can change between the
    listing and the transaction changes nothing decided in it: a file's name is its own
    (a random generation; a commit never adopts a file it did not write), so one no row
    names inside the transaction was named by none when listed; a file listed as old is
    none an in-flight commit writes (a commit writes only under names it has just made);
    and a row whose file was not listed (committed since) has its file looked for again
    before it is called missing."""
    entries = _list_dir(fd, unit, grace_seconds)
    span = _prefix_range(unit)
    named_packs: list[tuple[str, str]] = []
    with index.write_txn(conn):
        rows = dict(conn.execute(
            "SELECT key, generation FROM objects WHERE key >= ? AND key < ? "
            "AND file_key IS NULL", span))
        packs = set(conn.execute(
            "SELECT DISTINCT file_key, generation FROM objects WHERE file_key >= ? "
            "AND file_key < ?", span))
        present = set()
        for e in entries:
            # A symlink is never an object's file: it is removed (unlink does not follow
            # it) and the row it posed for is reported missing.
            named = rows.get(e.key) == e.generation or (e.key, e.generation) in packs
            if not e.is_temp and named and e.is_regular:
                present.add((e.key, e.generation))
                if (e.key, e.generation) in packs:
                    named_packs.append((e.key, e.generation))
                continue
            if not e.old:
                continue
            if not e.is_temp:
                # Inside the transaction, where a commit's re-check of its own files
                # is made too; an fsync under the lock, but only where an old file no
                # row names is found: after a crash or a failed slice.
                durable()
            try:
                ops.unlink(e.name, fd)
            except FileNotFoundError:
                continue
            if e.is_temp:
                result.temp_files_removed += 1
            else:
                result.orphan_files_removed += 1
        lost: dict[tuple[str, str], bool] = {}

        def no_file(file: tuple[str, str]) -> bool:
            if file in present:
                return False
            if file not in lost:
                lost[file] = not _regular(fd, *file)
            return lost[file]

        gone = [(k, g) for k, g in conn.execute(
            "SELECT key, generation FROM objects WHERE key >= ? AND key < ? "
            "AND state = 'live' AND file_key IS NULL", span) if no_file((k, g))]
        gone += [(k, g) for k, g, f in conn.execute(
            "SELECT key, generation, file_key FROM objects WHERE file_key >= ? "
            "AND file_key < ? AND state = 'live'", span) if no_file((f, g))]
        conn.executemany(
            "UPDATE objects SET state = 'quarantined', file_key = NULL, file_offset = 0 "
            "WHERE key = ? AND generation = ?", gone)
    # A pack's rows only ever go (collected, quarantined, punched out of it): bytes no
    # row covers now stay uncovered, so they are punched outside the transaction, once
    # the deletions that uncovered them are durable (``durable``).
    for key, generation in named_packs:
        result.pack_ranges_freed += _free_dead_ranges(conn, ops, fd, key, generation,
                                                      durable)
    return gone


def _regular(fd: int, key: str, generation: str) -> bool:
    try:
        st = os.stat(object_name(key, generation), dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode)


def pack_records(conn: sqlite3.Connection, file_key: str,
                 generation: str) -> list[tuple[int, int]]:
    """``(offset, payload bytes)`` of the records rows name in pack ``file_key.generation``."""
    return conn.execute(
        "SELECT file_offset, bytes FROM objects WHERE file_key = ? AND generation = ?",
        (file_key, generation)).fetchall()


def dead_ranges(records: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of the bytes of a pack of ``size`` bytes that none of
    ``records`` (``pack_records``) covers: records collected, quarantined or never adopted."""
    ranges, at = [], 0
    for offset, nbytes in sorted(records):
        if offset > at:
            ranges.append((at, offset - at))
        at = max(at, offset + record_span(nbytes))
    if size > at:
        ranges.append((at, size - at))
    return ranges


def first_data(fd: int, offset: int, length: int) -> int | None:
    """Where the first whole block inside ``offset .. offset + length`` of ``fd`` that
    still holds data begins, or None if none does (the partial blocks at the ends of a
    punched range always do)."""
    start = -(-offset // BLOCK) * BLOCK
    end = (offset + length) // BLOCK * BLOCK
    if start >= end:
        return None
    try:
        at = os.lseek(fd, start, os.SEEK_DATA)
    except OSError:  # ENXIO: no data from there to the end
        return None
    return at // BLOCK * BLOCK if at < end else None


def unfreed_ranges(records: list[tuple[int, int]], fd: int) -> list[tuple[int, int]]:
    """The ``dead_ranges`` of the pack open as ``fd`` that still hold data, each from its
    first block that does: collected records not punched yet (collection defers it, a
    crash can come first, and a slice punches a long range a piece at a time)."""
    out = []
    for offset, length in dead_ranges(records, os.fstat(fd).st_size):
        at = first_data(fd, offset, length)  # a whole block's start: never before offset
        if at is not None:
            out.append((at, offset + length - at))
    return out


def _free_dead_ranges(conn: sqlite3.Connection, ops: FileOps, dir_fd: int, key: str,
                      generation: str, durable: Callable[[], None]) -> int:
    """Punch the bytes of named pack ``key.generation`` (under ``dir_fd``) that no row
    covers and that still hold data: what a crash left before collection's deferred
    punches (``PageStore``); how many ranges were freed. ``durable()`` first, if any."""
    try:
        fd = ops.open(object_name(key, generation), _PUNCH_FLAGS, 0, dir_fd)
    except OSError as exc:
        log.warning("could not open pack %s.%s: %s", key, generation, exc)
        return 0
    freed = 0
    try:
        for offset, length in unfreed_ranges(pack_records(conn, key, generation), fd):
            durable()
            if ops.punch_hole(fd, offset, length):
                freed += 1
    finally:
        ops.close(fd)
    return freed
