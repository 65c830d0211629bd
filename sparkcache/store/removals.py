"""Reading a rank's removal log (``index._REMOVALS_SCHEMA``): the pages that stopped being
restorable since a cursor, in order, from a read-only connection."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass

from sparkcache.store import index


@dataclass(frozen=True)
class Removals:
    """What the log says since a cursor: ``keys`` removed, in order, up to ``cursor``
    (the last ``seq`` read: pass it back next time). ``lost``: the log cannot say what
    happened since the cursor given (rows trimmed before they were read, or the log is
    another store's, whose end lies below the cursor): every page may have gone."""

    keys: list[str]
    cursor: int
    lost: bool = False


def log_end(conn: sqlite3.Connection) -> int | None:
    """The last ``seq`` the log has given (0: none yet); None for an index made before
    the log (a store no writer of this version has opened)."""
    try:
        row = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'removals'").fetchone()
    except sqlite3.OperationalError:  # no AUTOINCREMENT table yet: no sqlite_sequence
        row = None
    if row is not None:
        return int(row[0])
    has_log = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' "
                           "AND name = 'removals'").fetchone()
    return 0 if has_log else None


def removals_since(conn: sqlite3.Connection, cursor: int, limit: int) -> Removals:
    """At most ``limit`` removals after ``cursor``, in one snapshot."""
    with index.read_txn(conn):
        end = log_end(conn)
        if end is None:
            return Removals([], cursor)
        if end < cursor:
            return Removals([], end, lost=True)
        rows = conn.execute("SELECT seq, key FROM removals WHERE seq > ? ORDER BY seq LIMIT ?",
                            (cursor, limit)).fetchall()
    # seq is contiguous (a rolled-back insert gives its number back): a first row past
    # cursor + 1, or none where the log went further, means rows were trimmed unread.
    first_expected = cursor + 1
    if (rows and rows[0][0] != first_expected) or (not rows and end > cursor):
        return Removals([key for _, key in rows], rows[-1][0] if rows else end, lost=True)
    return Removals([key for _, key in rows], rows[-1][0] if rows else cursor)


def restorable(conn: sqlite3.Connection, keys: Sequence[str]) -> set[str]:
    """Those of ``keys`` whose page a restore can read: live and referenced by a root.
    One row back a chunk of keys, not a row a key: each row fetched takes the GIL back,
    which a thread beside a busy one (KV events beside vLLM's scheduler) waits for."""
    out: set[str] = set()
    for part in index.chunks(list(keys)):
        marks = ",".join("?" * len(part))
        found = conn.execute(
            f"SELECT group_concat(key, '') FROM objects WHERE key IN ({marks}) "
            "AND refcount > 0 AND state = 'live'", tuple(part)).fetchone()[0] or ""
        width = len(part[0])
        out.update(found[i:i + width] for i in range(0, len(found), width))
    return out
