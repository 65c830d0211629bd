"""The SQLite index of one rank: schema, connections and transactions.

WAL mode, so readers (lookup, restore) work on a snapshot and never block the one writer;
``synchronous=FULL`` so a transaction that returned is on disk (a commit is acknowledged
only after that). Writers take the lock up front with ``BEGIN IMMEDIATE`` so that the
re-checks made inside a transaction cannot be invalidated before it commits.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from sparkcache.store.layout import FILE_MODE
from sparkcache.store.records import StoreError, UnsafeStoreDir, causes

# 2: object rows name the file their record is in (``file_key``, ``file_offset``); a
# publication's new pages share one file (docs/store.md, "Packs"). An index of version 1
# is upgraded by the first writer that opens it (``_upgrade_packs``); code of version 1
# refuses a version-2 index rather than misread its packs as missing files.
SCHEMA_VERSION = "2"
# The WAL is cut back to this when a checkpoint lets it restart; SQLite otherwise keeps
# the file at the largest size it ever reached (one transaction of many rows, say) for
# the store's life.
WAL_SIZE_LIMIT = 64 * 1024 * 1024
BUSY_TIMEOUT_MS = 30_000
# A read-only connection is the engine's: it gives up after this rather than wait (a WAL
# reader waits only in rare moments, such as another process recovering the WAL).
READONLY_BUSY_TIMEOUT_MS = 5
# SQLite's default limit on host parameters is 32766 since 3.32; stay far below it.
_CHUNK = 500

T = TypeVar("T")

# reader.chained_prefix reads every quarantined key at each lookup; there are few or none,
# and this keeps that read O(quarantined). Added after stores existed, so a writer's
# connect(create=True) adds it to an older index too.
_QUARANTINED_INDEX = (
    "CREATE INDEX IF NOT EXISTS objects_quarantined ON objects(key) WHERE state = 'quarantined';"
)

# The records of one pack: collection asks whether any row still names a pack before
# unlinking it, and recovery which packs a fan-out directory's rows name.
_PACKS_INDEX = (
    "CREATE INDEX IF NOT EXISTS objects_file ON objects(file_key, generation) "
    "WHERE file_key IS NOT NULL;"
)

# Objects awaiting collection (refcount 0) and a root cut short by eviction (which keeps a
# shorter, still valid root: ``store/eviction.py``), counted by triggers like the rest of
# ``totals``, so that usage() reads one row instead of counting the garbage, which after a
# large eviction is thousands of rows. Added after stores existed: ``_upgrade`` adds them
# to an older index, with the row counted once, in one transaction.
_GARBAGE_SCHEMA = (
    """CREATE TRIGGER IF NOT EXISTS garbage_ins AFTER INSERT ON objects
    WHEN NEW.refcount = 0 BEGIN
    UPDATE totals SET count = count + 1, bytes = bytes + NEW.bytes WHERE name = 'garbage';
END;""",
    """CREATE TRIGGER IF NOT EXISTS garbage_del AFTER DELETE ON objects
    WHEN OLD.refcount = 0 BEGIN
    UPDATE totals SET count = count - 1, bytes = bytes - OLD.bytes WHERE name = 'garbage';
END;""",
    """CREATE TRIGGER IF NOT EXISTS garbage_upd AFTER UPDATE OF refcount, bytes ON objects
    WHEN OLD.refcount = 0 OR NEW.refcount = 0 BEGIN
    UPDATE totals SET
        count = count - (OLD.refcount = 0) + (NEW.refcount = 0),
        bytes = bytes - (CASE WHEN OLD.refcount = 0 THEN OLD.bytes ELSE 0 END)
                      + (CASE WHEN NEW.refcount = 0 THEN NEW.bytes ELSE 0 END)
    WHERE name = 'garbage';
END;""",
    """CREATE TRIGGER IF NOT EXISTS roots_upd AFTER UPDATE OF bytes ON roots BEGIN
    UPDATE totals SET bytes = bytes - OLD.bytes + NEW.bytes WHERE name = 'roots';
END;""",
    "INSERT OR IGNORE INTO totals SELECT 'garbage', count(*), coalesce(sum(bytes), 0) "
    "FROM objects WHERE refcount = 0;",
)
# Read leases (docs/maintenance.md, "Leases at the cap"): one row per read in flight and
# root it reads, named by the read's ``lease`` id: a lookup's lease of the prefix it
# counted, until its load reports (the client's release) and capture's of the prefix it
# did not copy, until its commit. Ended by id, so one read's release never ends another's
# protection of the same root; ``until`` bounds a lease whose release never comes, and
# eviction at the cap may take one older than ``store.eviction.READ_GRACE_S``. Kept
# apart from ``roots.lease_until`` (the conversation's lease, which yields at the cap
# whatever its age). A row goes with its root (the trigger). ``read_leases`` (one row a
# root, no id) is what the first version of these leases kept: a writer's
# connect(create=True) replaces it (``_add_schema``); its rows, at most
# ``lookup_lease_seconds`` old, protected reads of processes a restart ended.
_READ_LEASES_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS reads(
    root_id TEXT NOT NULL,
    lease INTEGER NOT NULL,
    taken REAL NOT NULL,
    until REAL NOT NULL,
    PRIMARY KEY (root_id, lease)
) WITHOUT ROWID;""",
    "CREATE INDEX IF NOT EXISTS reads_lease ON reads(lease);",
    "CREATE INDEX IF NOT EXISTS reads_until ON reads(until);",
    """CREATE TRIGGER IF NOT EXISTS roots_del_reads AFTER DELETE ON roots BEGIN
    DELETE FROM reads WHERE root_id = OLD.id;
END;""",
    "DROP TRIGGER IF EXISTS roots_del_read_lease;",
    "DROP TABLE IF EXISTS read_leases;",
)
# The removal log (docs/store.md, "The removal log"): a row for each page that stops
# being restorable (its last reference dropped, quarantined, or deleted while referenced),
# in the transaction that did it, so a reader that remembers the last ``seq`` it read
# learns every removal since in order, without scanning the store: what KV events tell a
# router (``sparkcache.vllm.kv_events``). ``AUTOINCREMENT`` keeps ``seq`` rising after the
# log empties; a reader finding the log's end below its cursor is on another store. Every
# 1,024th row trims the log to its last ``REMOVALS_KEPT`` rows (at most 1,024 deleted a
# time, inside the writer's transaction); a reader that fell further behind sees a gap.
REMOVALS_KEPT = 262_144
_REMOVALS_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS removals(
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL
);""",
    """CREATE TRIGGER IF NOT EXISTS removals_unref AFTER UPDATE OF refcount ON objects
WHEN OLD.refcount > 0 AND NEW.refcount = 0 AND OLD.state = 'live' BEGIN
    INSERT INTO removals(key) VALUES (OLD.key);
END;""",
    """CREATE TRIGGER IF NOT EXISTS removals_quarantined AFTER UPDATE OF state ON objects
WHEN OLD.state = 'live' AND NEW.state != 'live' AND OLD.refcount > 0 BEGIN
    INSERT INTO removals(key) VALUES (OLD.key);
END;""",
    """CREATE TRIGGER IF NOT EXISTS removals_deleted AFTER DELETE ON objects
WHEN OLD.state = 'live' AND OLD.refcount > 0 BEGIN
    INSERT INTO removals(key) VALUES (OLD.key);
END;""",
    f"""CREATE TRIGGER IF NOT EXISTS removals_trim AFTER INSERT ON removals
WHEN NEW.seq % 1024 = 0 BEGIN
    DELETE FROM removals WHERE seq <= NEW.seq - {REMOVALS_KEPT};
END;""",
)
# totals rows that are not object states (usage() sums the states into used bytes).
TOTALS_NOT_STATES = frozenset({"roots", "garbage"})

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS objects(
    key TEXT PRIMARY KEY,
    generation TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    refcount INTEGER NOT NULL CHECK (refcount >= 0),
    state TEXT NOT NULL CHECK (state IN ('live', 'quarantined')),
    created REAL NOT NULL,
    file_key TEXT,
    file_offset INTEGER NOT NULL DEFAULT 0,
    hold_until REAL
) WITHOUT ROWID;
-- Collection reads only unreferenced objects; a partial index makes that O(n collected).
CREATE INDEX IF NOT EXISTS objects_garbage ON objects(key) WHERE refcount = 0;
CREATE TABLE IF NOT EXISTS roots(
    id TEXT PRIMARY KEY,
    bytes INTEGER NOT NULL,
    pages INTEGER NOT NULL,
    created REAL NOT NULL,
    last_access REAL NOT NULL,
    lease_until REAL NOT NULL
) WITHOUT ROWID;
-- Victim selection walks this index in order and stops after k rows: O(k log n).
CREATE INDEX IF NOT EXISTS roots_lru ON roots(lease_until, last_access);
CREATE TABLE IF NOT EXISTS root_pages(
    root_id TEXT NOT NULL,
    pos INTEGER NOT NULL,
    key TEXT NOT NULL,
    PRIMARY KEY (root_id, pos)
) WITHOUT ROWID;
-- Restores renew the roots holding (key, pos); chained keys make that the whole prefix.
CREATE INDEX IF NOT EXISTS root_pages_key ON root_pages(key, pos);
-- Running totals kept by triggers in the same transactions, so usage() never scans.
CREATE TABLE IF NOT EXISTS totals(
    name TEXT PRIMARY KEY,
    count INTEGER NOT NULL,
    bytes INTEGER NOT NULL
) WITHOUT ROWID;
INSERT OR IGNORE INTO totals VALUES ('roots', 0, 0), ('live', 0, 0), ('quarantined', 0, 0);
""" + _PACKS_INDEX + """
CREATE TRIGGER IF NOT EXISTS objects_ins AFTER INSERT ON objects BEGIN
    UPDATE totals SET count = count + 1, bytes = bytes + NEW.bytes WHERE name = NEW.state;
END;
CREATE TRIGGER IF NOT EXISTS objects_del AFTER DELETE ON objects BEGIN
    UPDATE totals SET count = count - 1, bytes = bytes - OLD.bytes WHERE name = OLD.state;
END;
CREATE TRIGGER IF NOT EXISTS objects_upd AFTER UPDATE OF state, bytes ON objects BEGIN
    UPDATE totals SET count = count - 1, bytes = bytes - OLD.bytes WHERE name = OLD.state;
    UPDATE totals SET count = count + 1, bytes = bytes + NEW.bytes WHERE name = NEW.state;
END;
CREATE TRIGGER IF NOT EXISTS roots_ins AFTER INSERT ON roots BEGIN
    UPDATE totals SET count = count + 1, bytes = bytes + NEW.bytes WHERE name = 'roots';
END;
CREATE TRIGGER IF NOT EXISTS roots_del AFTER DELETE ON roots BEGIN
    UPDATE totals SET count = count - 1, bytes = bytes - OLD.bytes WHERE name = 'roots';
END;
""" + "\n".join(_GARBAGE_SCHEMA + _READ_LEASES_SCHEMA + _REMOVALS_SCHEMA)


def check_db_file(path: Path, create: bool) -> None:
    """Refuse a symlinked or foreign SQLite file (an index, the KV events ledger); create
    a missing one with mode 0600."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not create:
            raise StoreError(f"no index at {path}") from None
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                             FILE_MODE))
            return
        except FileExistsError:
            # Another process made it since: on a fresh store the rank's commit and
            # maintenance workers start together, and the loser died at start-up (seen
            # on 16 cores), failing the supervisor's start. Theirs is checked as any is.
            st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeStoreDir(f"{path} is not a regular file (symlink?); refusing to open it")
    if st.st_uid != os.geteuid():
        raise UnsafeStoreDir(f"{path} is owned by uid {st.st_uid}, not by this user")
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.is_symlink():
            raise UnsafeStoreDir(f"{side} is a symlink; refusing to open the index")


def connect(path: Path, create: bool, readonly: bool = False,
            durable: bool = True) -> sqlite3.Connection:
    """Open the index, creating the schema if asked; fail closed on anything unreadable.
    ``readonly``: the connection cannot write (SQLite refuses) and waits at most
    READONLY_BUSY_TIMEOUT_MS for a lock. ``durable=False``: its transactions are not
    fsynced at COMMIT (a later durable one carries them to disk), for writes a crash may
    lose, such as leases."""
    check_db_file(path, create and not readonly)
    try:
        if readonly:
            uri = f"file:{urllib.parse.quote(str(path))}?mode=ro"
            timeout_ms = READONLY_BUSY_TIMEOUT_MS
            conn = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=timeout_ms / 1000)
            conn.execute(f"PRAGMA busy_timeout={timeout_ms}")
            mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        else:
            conn = sqlite3.connect(path, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
            conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            mode = _into_wal(conn)
            conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
            conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
        if mode != "wal":
            raise StoreError(f"index {path} is not in WAL mode (mode {mode})")
        version = _schema_version(conn, path, create and not readonly)
    except sqlite3.DatabaseError as exc:
        raise StoreError(f"index {path} cannot be read: {exc}") from exc
    if version != SCHEMA_VERSION:
        conn.close()
        raise StoreError(f"index {path} has schema version {version}, expected {SCHEMA_VERSION}")
    return conn


def _into_wal(conn: sqlite3.Connection) -> str:
    """Put the index in WAL mode, waiting up to BUSY_TIMEOUT_MS for the lock; the mode it
    is in. WAL is a property of the file: once made, only read here. Converting a fresh
    file needs its exclusive lock, and while another connection holds the file's write
    lock SQLite fails the conversion at once, without its busy handler: two writers
    opening a new index together (a fresh store's commit and maintenance workers) had one
    fail with "database is locked", and the supervisor's start with it."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        if mode == "wal":
            return mode
        try:
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode != sqlite3.SQLITE_BUSY or time.monotonic() > deadline:
                raise
        else:
            if mode == "wal" or time.monotonic() > deadline:
                return mode  # (another mode refused: the caller says so)
        time.sleep(0.005)


def _schema_version(conn: sqlite3.Connection, path: Path, create: bool) -> str | None:
    has_meta = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'"
    ).fetchone()
    if has_meta is None:
        if not create:
            raise StoreError(f"index {path} has no schema")
        # executescript commits on its own; the schema is idempotent, so a racing
        # creator in another process does no harm.
        conn.executescript(
            "BEGIN IMMEDIATE;"
            + _SCHEMA
            + f"INSERT OR IGNORE INTO meta VALUES ('schema_version', '{SCHEMA_VERSION}');"
            + "COMMIT;"
        )
    if create:
        conn.execute(_QUARANTINED_INDEX)
        _upgrade(conn)
        _upgrade_packs(conn)
        _upgrade_hold(conn)
        _add_schema(conn, "roots_del_reads", _READ_LEASES_SCHEMA)
        _add_schema(conn, "removals_trim", _REMOVALS_SCHEMA)
    row = conn.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()
    return None if row is None else row[0]


def _upgrade(conn: sqlite3.Connection) -> None:
    """Add the garbage totals to an index made before them (see ``_GARBAGE_SCHEMA``)."""
    if conn.execute("SELECT 1 FROM totals WHERE name = 'garbage'").fetchone():
        return
    # Triggers and the first count in one write transaction: no commit can slip between.
    conn.executescript("BEGIN IMMEDIATE;" + "\n".join(_GARBAGE_SCHEMA) + "COMMIT;")


def _upgrade_packs(conn: sqlite3.Connection) -> None:
    """Version 1 to 2: the pack columns (NULL and 0: every version-1 object is a file of
    its own, which is what they mean) and their index, in one write transaction that
    re-reads the version, so two writers opening an old index upgrade it once."""
    version = "SELECT value FROM meta WHERE name = 'schema_version'"
    if conn.execute(version).fetchone() != ("1",):
        return
    with write_txn(conn):
        if conn.execute(version).fetchone() != ("1",):
            return
        conn.execute("ALTER TABLE objects ADD COLUMN file_key TEXT")
        conn.execute("ALTER TABLE objects ADD COLUMN file_offset INTEGER NOT NULL DEFAULT 0")
        conn.execute(_PACKS_INDEX)
        conn.execute("UPDATE meta SET value = ? WHERE name = 'schema_version'",
                     (SCHEMA_VERSION,))


def _upgrade_hold(conn: sqlite3.Connection) -> None:
    """Add ``hold_until`` to an index made before it: NULL holds nothing, which is what
    every row written before it means. Code that predates it ignores the column (it may
    collect a staged page early, which only costs that publication its commit), so the
    schema version stays."""
    def has_hold() -> bool:
        return any(row[1] == "hold_until" for row in conn.execute("PRAGMA table_info(objects)"))

    if has_hold():
        return
    with write_txn(conn):
        if not has_hold():
            conn.execute("ALTER TABLE objects ADD COLUMN hold_until REAL")


def _add_schema(conn: sqlite3.Connection, last_trigger: str, schema: Sequence[str]) -> None:
    """Add a part of the schema to an index made before it, in one write transaction:
    the read leases (``_READ_LEASES_SCHEMA``) or the removal log (``_REMOVALS_SCHEMA``),
    known present by the last trigger it makes. Code that predates either reads and
    writes such an index as before, so the schema version stays."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'trigger' AND name = ?",
                    (last_trigger,)).fetchone():
        return
    conn.executescript("BEGIN IMMEDIATE;" + "\n".join(schema) + "COMMIT;")


class OutcomeUnknown(StoreError):
    """COMMIT itself failed: the transaction may or may not be durable."""


class IndexSyncFailed(OutcomeUnknown):
    """An fsync of the index (its WAL, or the file) failed. The kernel may have dropped
    the pages it could not write and marked them clean, so a later fsync can succeed
    while a transaction committed before it is lost at the next power cut, and with it
    every later one the WAL replays after it (SQLite stops at the first frame that does
    not check out). Nothing written to the index since can be acknowledged as durable:
    a worker that meets this stops (an environment fault), as PostgreSQL does."""


# SQLite's extended result codes for a failed fsync of a file or of its directory.
_SQLITE_SYNC_FAILED = frozenset({1034, 5130})  # SQLITE_IOERR_FSYNC, SQLITE_IOERR_DIR_FSYNC
_SYNC_ADVICE = ("nothing more is acknowledged: check the disk (the kernel log), run "
                "`sparkcache fsck`, then restart the supervisor")


def sync_failed(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an error it was raised from, is a failed fsync of the index
    (``IndexSyncFailed``, or SQLite's own at a COMMIT or a checkpoint)."""
    return any(
        isinstance(e, IndexSyncFailed) or (
            isinstance(e, sqlite3.Error)
            and getattr(e, "sqlite_errorcode", None) in _SQLITE_SYNC_FAILED)
        for e in causes(exc))


@contextmanager
def write_txn(conn: sqlite3.Connection, locked: Callable[[float], None] | None = None,
              ) -> Iterator[sqlite3.Connection]:
    """``BEGIN IMMEDIATE`` ... ``COMMIT``; rolled back on any exception before COMMIT.
    ``locked``, if given, is told the seconds BEGIN waited for the write lock.

    A failing COMMIT raises OutcomeUnknown: after an I/O error the WAL frames may still
    reach the disk and be replayed, so callers must not undo what the transaction refers to.
    """
    asked = time.perf_counter()
    conn.execute("BEGIN IMMEDIATE")
    if locked is not None:
        locked(time.perf_counter() - asked)
    try:
        yield conn
    except BaseException:
        # SQLite may already have rolled back (e.g. after SQLITE_FULL).
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    try:
        conn.execute("COMMIT")
    except sqlite3.Error as exc:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        if sync_failed(exc):
            raise IndexSyncFailed(f"an fsync of the index failed at a COMMIT ({exc}); "
                                  f"{_SYNC_ADVICE}") from exc
        raise OutcomeUnknown(f"index COMMIT failed: {exc}") from exc


@contextmanager
def unsynced(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """Transactions inside commit without fsyncing the WAL (``synchronous=NORMAL``): a
    crash of the process loses nothing (the frames are in the page cache), a power cut may
    lose them, and the next synced transaction makes them durable with it (the WAL is one
    file, written in order). Only for writes whose loss leaves the index consistent, so
    that no fsync of theirs holds the write lock while commits wait for it."""
    level = int(conn.execute("PRAGMA synchronous").fetchone()[0])
    conn.execute("PRAGMA synchronous=NORMAL")
    try:
        yield conn
    finally:
        conn.execute(f"PRAGMA synchronous={level}")


def sync_wal(path: Path) -> None:
    """fsync the WAL of the index at ``path``: every transaction committed before the
    call, synced or not (``unsynced``), is durable once it returns. Outside any
    transaction, so no lock is held while the disk answers. Without a WAL file (its last
    connection checkpointed it away) the index file itself is synced. A failed fsync is
    ``IndexSyncFailed``: never tried again (the next would say nothing of this one's
    pages)."""
    wal = path.with_name(path.name + "-wal")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(wal, flags)
    except FileNotFoundError:
        fd = os.open(path, flags)
    try:
        os.fdatasync(fd)
    except OSError as exc:
        raise IndexSyncFailed(f"an fsync of the index's WAL failed ({exc}); "
                              f"{_SYNC_ADVICE}") from exc
    finally:
        os.close(fd)


@contextmanager
def read_txn(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """A deferred transaction: every read inside sees one snapshot."""
    conn.execute("BEGIN")
    try:
        yield conn
    finally:
        conn.execute("COMMIT")


def chunks(items: Sequence[T], size: int = _CHUNK) -> Iterable[Sequence[T]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def rows_for_keys(conn: sqlite3.Connection, columns: str, keys: Sequence[str]) -> dict[str, tuple]:
    """``key -> (columns...)`` for the object rows of ``keys`` (missing keys absent)."""
    out: dict[str, tuple] = {}
    for part in chunks(list(keys)):
        marks = ",".join("?" * len(part))
        for row in conn.execute(
            f"SELECT key, {columns} FROM objects WHERE key IN ({marks})", tuple(part)
        ):
            out[row[0]] = row[1:]
    return out
