"""Offline consistency check of a store: every invariant, one problem line each.

Checks per rank: ``PRAGMA integrity_check``; every referenced object has a row; every live
object's file exists, is a regular file (never a followed symlink) and verifies (length,
key, generation, checksum); refcounts equal references; no dangling page rows; root page
counts and the running totals match the rows; no temporary or orphan file, nor anything the
store did not create, under ``objects/`` older than the grace period; nothing but pooled
files (plain files named as ``store/pool.py`` names them) under ``free/``. Quarantined
objects are known-bad and already misses, and pooled files are free space: both are
counted, not reported as problems; so are the blocks of collected records a pack still
holds (``unpunched_bytes``: collection punches them after a delay, reconcile after a
crash).
"""

from __future__ import annotations

import os
import sqlite3
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from sparkcache.store import index
from sparkcache.store.fileops import FileOps
from sparkcache.store.layout import (
    DIR_FLAGS,
    RankLayout,
    fanout,
    list_ranks,
    open_subdir,
    parse_object_name,
)
from sparkcache.store.objects import ObjectCorrupt, verify_file
from sparkcache.store.pool import parse_free_name
from sparkcache.store.records import StoreError
from sparkcache.store.recovery import unfreed_ranges
from sparkcache.store.store import PageStore

DEFAULT_FSCK_GRACE_SECONDS = 300.0


@dataclass
class FsckReport:
    ok: bool = True
    roots: int = 0
    objects: int = 0
    quarantined: int = 0
    pooled_files: int = 0
    pooled_bytes: int = 0
    # Collected records' blocks still in packs: collection punches them after a delay
    # (store.PUNCH_DELAY_S), and reconcile after a crash. Counted, not a problem.
    unpunched_bytes: int = 0
    problems: list[str] = field(default_factory=list)

    def add(self, problem: str) -> None:
        self.ok = False
        self.problems.append(problem)

    def as_json(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "roots": self.roots,
            "objects": self.objects,
            "quarantined": self.quarantined,
            "pooled_files": self.pooled_files,
            "pooled_bytes": self.pooled_bytes,
            "unpunched_bytes": self.unpunched_bytes,
            "problems": self.problems,
        }


def fsck(
    store_dir: Path,
    grace_seconds: float = DEFAULT_FSCK_GRACE_SECONDS,
    repair: bool = False,
) -> FsckReport:
    """Check every rank under ``store_dir``; with ``repair``, reconcile and quarantine first."""
    report = FsckReport()
    try:
        ranks = list_ranks(store_dir)
    except (OSError, StoreError) as exc:
        report.add(f"store {store_dir}: {exc}")
        return report
    for rank in ranks:
        layout = RankLayout(store_dir, rank)
        if repair:
            _repair(layout, grace_seconds, report)
        _check_rank(layout, grace_seconds, report)
    return report


def _repair(layout: RankLayout, grace_seconds: float, report: FsckReport) -> None:
    try:
        with PageStore(layout.store_dir, layout.rank, create=False) as store:
            store.reconcile(grace_seconds)
            for key, generation, size, file_key, offset in _live_objects(layout):
                problem = _verify(layout, key, generation, size, file_key, offset)
                if problem is not None:
                    store.quarantine(key, generation, problem)
    except (OSError, StoreError, sqlite3.Error) as exc:
        report.add(f"rank {layout.rank}: repair failed: {exc}")


def _live_objects(layout: RankLayout) -> list[tuple[str, str, int, str | None, int]]:
    conn = index.connect(layout.index_path, create=False)
    try:
        return conn.execute(
            "SELECT key, generation, bytes, file_key, file_offset FROM objects "
            "WHERE state = 'live'"
        ).fetchall()
    finally:
        conn.close()


def _verify(layout: RankLayout, key: str, generation: str, size: int,
            file_key: str | None, offset: int) -> str | None:
    """None if the object (its file, or its record in pack ``file_key``) verifies, else
    what is wrong with it."""
    objects_fd = os.open(layout.objects_dir, DIR_FLAGS)
    try:
        fd = open_subdir(fanout(file_key or key), objects_fd, create=False)
        try:
            verify_file(FileOps(), fd, key, generation, size, file_key, offset)
        finally:
            os.close(fd)
    except FileNotFoundError:
        return "file missing"
    except (ObjectCorrupt, StoreError, OSError) as exc:
        return str(exc)
    finally:
        os.close(objects_fd)
    return None


def _check_rank(layout: RankLayout, grace_seconds: float, report: FsckReport) -> None:
    where = f"rank {layout.rank}"
    try:
        layout.prepare(create=False)
        conn = index.connect(layout.index_path, create=False)
    except (OSError, StoreError) as exc:
        report.add(f"{where}: cannot open: {exc}")
        return
    try:
        _check_index(conn, where, report)
        rows: dict[str, str] = {}  # object files: key -> generation
        packs: dict[tuple[str, str], list[tuple[int, int]]] = {}  # name -> its records
        for key, generation, size, state, file_key, offset in conn.execute(
            "SELECT key, generation, bytes, state, file_key, file_offset FROM objects"
        ):
            if file_key is None:
                rows[key] = generation
            else:
                packs.setdefault((file_key, generation), []).append((offset, size))
            if state == "quarantined":
                report.quarantined += 1
                continue
            problem = _verify(layout, key, generation, size, file_key, offset)
            if problem is not None:
                report.add(f"{where}: object {key}.{generation}: {problem}")
    except sqlite3.DatabaseError as exc:
        report.add(f"{where}: index cannot be read: {exc}")
        return
    finally:
        conn.close()
    _check_files(layout, rows, packs, grace_seconds, where, report)
    _check_pool(layout, where, report)


def _check_index(conn: sqlite3.Connection, where: str, report: FsckReport) -> None:
    for (line,) in conn.execute("PRAGMA integrity_check"):
        if line != "ok":
            report.add(f"{where}: integrity_check: {line}")
    report.roots += conn.execute("SELECT count(*) FROM roots").fetchone()[0]
    report.objects += conn.execute("SELECT count(*) FROM objects").fetchone()[0]
    for key, root_id in conn.execute(
        "SELECT rp.key, rp.root_id FROM root_pages rp "
        "LEFT JOIN objects o ON o.key = rp.key WHERE o.key IS NULL"
    ):
        report.add(f"{where}: root {root_id} references object {key} that has no row")
    for key, refcount, refs in conn.execute(
        "SELECT o.key, o.refcount, coalesce(c.n, 0) FROM objects o LEFT JOIN "
        "(SELECT key, count(*) AS n FROM root_pages GROUP BY key) c ON c.key = o.key "
        "WHERE o.refcount != coalesce(c.n, 0)"
    ):
        report.add(f"{where}: object {key} refcount {refcount} != {refs} references")
    for (root_id,) in conn.execute(
        "SELECT DISTINCT root_id FROM root_pages WHERE root_id NOT IN (SELECT id FROM roots)"
    ):
        report.add(f"{where}: page rows of missing root {root_id}")
    for root_id, pages, n in conn.execute(
        "SELECT r.id, r.pages, count(rp.pos) FROM roots r LEFT JOIN root_pages rp "
        "ON rp.root_id = r.id GROUP BY r.id HAVING r.pages != count(rp.pos)"
    ):
        report.add(f"{where}: root {root_id} has {n} page rows, expected {pages}")
    totals = {name: (c, b) for name, c, b in conn.execute("SELECT * FROM totals")}
    actual = {"roots": conn.execute("SELECT count(*), coalesce(sum(bytes), 0) FROM roots")}
    for state in ("live", "quarantined"):
        actual[state] = conn.execute(
            "SELECT count(*), coalesce(sum(bytes), 0) FROM objects WHERE state = ?", (state,)
        )
    if "garbage" in totals:  # an index not yet upgraded has none (index._upgrade)
        actual["garbage"] = conn.execute(
            "SELECT count(*), coalesce(sum(bytes), 0) FROM objects WHERE refcount = 0"
        )
    for name, cursor in actual.items():
        real = tuple(cursor.fetchone())
        if totals.get(name) != real:
            report.add(f"{where}: totals[{name}] {totals.get(name)} != actual {real}")


def _check_files(
    layout: RankLayout,
    rows: dict[str, str],
    packs: dict[tuple[str, str], list[tuple[int, int]]],
    grace_seconds: float,
    where: str,
    report: FsckReport,
) -> None:
    now = time.time()
    for entry in os.scandir(layout.objects_dir):
        if not entry.is_dir(follow_symlinks=False):
            report.add(f"{where}: unexpected entry objects/{entry.name}")
            continue
        for item in os.scandir(entry.path):
            st = item.stat(follow_symlinks=False)
            parsed = parse_object_name(item.name)
            rel = f"objects/{entry.name}/{item.name}"
            if parsed is None or not stat.S_ISREG(st.st_mode) or parsed[0][:2] != entry.name:
                report.add(f"{where}: unexpected entry {rel}")
                continue
            key, generation, is_temp = parsed
            if not is_temp and (key, generation) in packs:
                _check_pack(item.path, packs[key, generation], report)
                continue
            if not is_temp and rows.get(key) == generation:
                continue
            if now - st.st_mtime >= grace_seconds:
                kind = "temporary file" if is_temp else "orphan file"
                report.add(f"{where}: {kind} {rel}")


def _check_pack(path: str, records: list[tuple[int, int]], report: FsckReport) -> None:
    """Count a pack's bytes that no row's record covers and that are not yet freed."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        report.unpunched_bytes += sum(length for _, length in unfreed_ranges(records, fd))
    finally:
        os.close(fd)


def _check_pool(layout: RankLayout, where: str, report: FsckReport) -> None:
    if not os.path.lexists(layout.free_dir):
        return  # a store made before the pool
    for item in os.scandir(layout.free_dir):
        st = item.stat(follow_symlinks=False)
        if parse_free_name(item.name) is None or not stat.S_ISREG(st.st_mode):
            report.add(f"{where}: unexpected entry free/{item.name}")
            continue
        report.pooled_files += 1
        report.pooled_bytes += st.st_size
