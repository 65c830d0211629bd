"""Reconciliation after a crash: repair index rows, then sweep ``objects/`` against them.

Safe to run while other processes commit or collect: every decision about a file is taken
inside a write transaction (one per fan-out directory) that re-reads the rows of exactly
that directory, and a commit checks, inside its own write transaction, that the files it
is about to reference still exist. The SQLite write lock serialises the two, so reconcile
never removes a file a committed row names, and a commit never names a removed file.
Temporary files are only removed after ``grace_seconds``, so an in-flight commit's temp file
is left alone; if it is removed anyway, that commit fails cleanly.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import time
from dataclasses import dataclass

from sparkcache.store import index
from sparkcache.store.fileops import FileOps
from sparkcache.store.layout import is_fanout, open_subdir, parse_object_name
from sparkcache.store.records import StoreError

log = logging.getLogger(__name__)


@dataclass
class SweepResult:
    temp_files_removed: int = 0
    orphan_files_removed: int = 0
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


def _prefix_range(fan: str) -> tuple[str, str]:
    """Keys starting with the two hex digits ``fan`` sort in ``[fan, next)``."""
    upper = f"{int(fan, 16) + 1:02x}" if fan != "ff" else "g"
    return fan, upper


def sweep_files(
    conn: sqlite3.Connection, ops: FileOps, objects_fd: int, grace_seconds: float
) -> SweepResult:
    """Remove old temp files and files no row names; report live rows with no file."""
    result = SweepResult()
    missing: list[tuple[str, str]] = []
    for fan in sorted(os.listdir(objects_fd)):
        if not is_fanout(fan):
            log.warning("unexpected entry objects/%s left in place", fan)
            continue
        try:
            fd = open_subdir(fan, objects_fd, create=False)
        except (StoreError, OSError) as exc:
            log.warning("skipping objects/%s: %s", fan, exc)
            continue
        try:
            with index.write_txn(conn):
                missing += _sweep_dir(conn, ops, fd, fan, grace_seconds, result)
        finally:
            os.close(fd)
    result.missing = tuple(missing)
    return result


def _sweep_dir(
    conn: sqlite3.Connection,
    ops: FileOps,
    fd: int,
    fan: str,
    grace_seconds: float,
    result: SweepResult,
) -> list[tuple[str, str]]:
    """One fan-out directory, inside the caller's write transaction."""
    rows = dict(
        conn.execute(
            "SELECT key, generation FROM objects WHERE key >= ? AND key < ?", _prefix_range(fan)
        )
    )
    present = set()
    now = time.time()
    for name in os.listdir(fd):
        parsed = parse_object_name(name)
        if parsed is None or parsed[0][:2] != fan:
            log.warning("unexpected entry objects/%s/%s left in place", fan, name)
            continue
        key, generation, is_temp = parsed
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        # A symlink is never an object's file: it is removed (unlink does not follow it)
        # and the row it posed for is reported missing.
        if not is_temp and rows.get(key) == generation and stat.S_ISREG(st.st_mode):
            present.add(key)
            continue
        if now - st.st_mtime < grace_seconds:
            continue
        ops.unlink(name, fd)
        if is_temp:
            result.temp_files_removed += 1
        else:
            result.orphan_files_removed += 1
    live = conn.execute(
        "SELECT key, generation FROM objects WHERE key >= ? AND key < ? AND state = 'live'",
        _prefix_range(fan),
    ).fetchall()
    gone = [(k, g) for k, g in live if k not in present]
    conn.executemany(
        "UPDATE objects SET state = 'quarantined' WHERE key = ? AND generation = ?", gone
    )
    return gone
