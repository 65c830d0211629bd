"""A power-loss harness for the store, as crash-consistency tools build one (ALICE,
CrashMonkey): record what the store asks of the file system while it runs, then rebuild
the store as a power cut could have left it at every point, and check each state.

``RecordingOps`` (the store's ``FileOps``) performs every call and logs the ones that
change object files (creations, writes with their bytes, renames, unlinks, truncates,
punches) and the barriers (``syncfs``, a file's fsync). The index is SQLite's to keep
consistent: its state is copied (SQLite's backup) after every transaction, marked durable
when it was synced (a COMMIT under ``synchronous=FULL``, or ``index.sync_wal``) and merely
committed otherwise (collection's deletions, ``index.unsynced``).

A crash state at log position ``k`` keeps every file change up to the last barrier
before ``k`` and a subset of the changes between it and ``k`` (none, all, or random ones,
applied in order: what reaches the disk unsynced is anyone's guess), with the index as
last made durable, or as last committed (its WAL frames reached the disk in order). Each
state must pass fsck as it is (no row, garbage included, names a file or record that is
not there whole; files no row names are allowed), then once repaired as
``fsck --repair`` does (``reconcile``); every root it holds must restore byte for
byte, and every root acknowledged before ``k`` and not evicted must be there.
Directories are taken as always present (the store makes them once and never removes
them).
"""

from __future__ import annotations

import os
import random
import shutil
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from sparkcache.store import PageStore, index
from sparkcache.store.fileops import FileOps
from sparkcache.store.fsck import fsck
from sparkcache.store.layout import fanout
from sparkcache.store.objects import ObjectCorrupt, verify_file
from sparkcache.store.testing import page_bytes


@dataclass
class Change:
    """One logged change of an object file (``path`` relative to the rank directory)."""

    kind: str  # create, write, rename, unlink, truncate, punch, syncfs, fsync
    path: str = ""
    other: str = ""  # rename's destination
    offset: int = 0
    data: bytes = b""
    size: int = 0  # truncate's size, punch's length


@dataclass
class IndexState:
    at: int  # the log position it was taken at
    durable: bool
    copy: Path


@dataclass
class Recording:
    rank_dir: Path
    log: list[Change] = field(default_factory=list)
    index: list[IndexState] = field(default_factory=list)
    # Roots acknowledged (commit returned) and evicted, with the log position.
    acked: list[tuple[int, str]] = field(default_factory=list)
    evicted: list[tuple[int, str]] = field(default_factory=list)


class RecordingOps(FileOps):
    """``FileOps`` that logs every change it makes to object files (``Recording``).
    ``drop_syncs``: sync calls that log no barrier (and are not made): a store without
    them, which the harness must catch."""

    def __init__(self, rec: Recording, drop_syncs: frozenset[str] = frozenset()) -> None:
        self.rec = rec
        self.drop = drop_syncs
        self._paths: dict[int, str] = {}

    def _path(self, name: str, dir_fd: int) -> str:
        where = Path(os.readlink(f"/proc/self/fd/{dir_fd}")) / name
        return str(where.relative_to(self.rec.rank_dir))

    def open(self, name: str, flags: int, mode: int, dir_fd: int) -> int:
        fd = super().open(name, flags, mode, dir_fd)
        path = self._path(name, dir_fd)
        self._paths[fd] = path
        if flags & os.O_CREAT:
            self.rec.log.append(Change("create", path))
        if flags & os.O_TRUNC:
            self.rec.log.append(Change("truncate", path, size=0))
        return fd

    def write(self, fd: int, pieces: list[memoryview]) -> int:
        offset = os.lseek(fd, 0, os.SEEK_CUR)
        n = super().write(fd, pieces)
        self.rec.log.append(Change("write", self._paths[fd], offset=offset,
                                   data=b"".join(bytes(p) for p in pieces)[:n]))
        return n

    def truncate(self, fd: int, size: int) -> None:
        super().truncate(fd, size)
        self.rec.log.append(Change("truncate", self._paths[fd], size=size))

    def punch_hole(self, fd: int, offset: int, length: int) -> bool:
        done = super().punch_hole(fd, offset, length)
        if done:
            self.rec.log.append(Change("punch", self._paths[fd], offset=offset, size=length))
        return done

    def rename(self, src: str, dst: str, src_dir_fd: int, dst_dir_fd: int) -> None:
        super().rename(src, dst, src_dir_fd, dst_dir_fd)
        old, new = self._path(src, src_dir_fd), self._path(dst, dst_dir_fd)
        self.rec.log.append(Change("rename", old, new))
        for fd, path in self._paths.items():
            if path == old:
                self._paths[fd] = new  # a pooled file, open, renamed onto a temp name

    def unlink(self, name: str, dir_fd: int) -> None:
        super().unlink(name, dir_fd)
        self.rec.log.append(Change("unlink", self._path(name, dir_fd)))

    def fsync(self, fd: int) -> None:
        if "fsync" in self.drop:
            return
        super().fsync(fd)
        self.rec.log.append(Change("fsync", self._paths.get(fd, "")))

    def sync_filesystem(self, fd: int) -> None:
        if "syncfs" in self.drop:
            return
        super().sync_filesystem(fd)
        self.rec.log.append(Change("syncfs"))

    @property
    def syncfs_reports_errors(self) -> bool:
        return True

    def close(self, fd: int) -> None:
        self._paths.pop(fd, None)
        super().close(fd)


@contextmanager
def recording_index(rec: Recording, index_path: Path,
                    snapshots: Path) -> Iterator[Callable[[bool], None]]:
    """Copy the index after every transaction the store commits and every sync of its
    WAL, each marked durable or not, at the log's position (``Recording.index``); yields
    the copier, for the state before the first transaction."""
    write_txn, sync_wal = index.write_txn, index.sync_wal
    snapshots.mkdir(parents=True, exist_ok=True)

    def take(durable: bool) -> None:
        copy = snapshots / f"{len(rec.index):05d}.sqlite"
        src = sqlite3.connect(index_path)
        dst = sqlite3.connect(copy)
        try:
            src.backup(dst)
        finally:
            src.close()
            dst.close()
        rec.index.append(IndexState(len(rec.log), durable, copy))

    @contextmanager
    def recorded_txn(conn: sqlite3.Connection, *args: object, **kwargs: object):
        with write_txn(conn, *args, **kwargs) as c:
            yield c
        full = int(conn.execute("PRAGMA synchronous").fetchone()[0]) >= 2
        take(durable=full)

    def recorded_sync(path: Path) -> None:
        sync_wal(path)
        take(durable=True)

    index.write_txn, index.sync_wal = recorded_txn, recorded_sync
    try:
        yield take
    finally:
        index.write_txn, index.sync_wal = write_txn, sync_wal


def _apply(files: dict[str, bytearray], c: Change) -> None:
    if c.kind == "create":
        files.setdefault(c.path, bytearray())
    elif c.path not in files:
        return  # a change to a file whose creation (or rename) did not reach the disk
    elif c.kind == "write":
        f = files[c.path]
        if len(f) < c.offset:
            f.extend(bytes(c.offset - len(f)))
        f[c.offset:c.offset + len(c.data)] = c.data
    elif c.kind == "truncate":
        f = files[c.path]
        del f[c.size:]
        f.extend(bytes(max(0, c.size - len(f))))
    elif c.kind == "punch":
        f = files[c.path]
        end = min(len(f), c.offset + c.size)
        f[c.offset:end] = bytes(max(0, end - c.offset))
    elif c.kind == "rename":
        files[c.other] = files.pop(c.path)
    elif c.kind == "unlink":
        del files[c.path]


def file_states(log: list[Change], k: int, rng: random.Random,
                subsets: int) -> Iterator[tuple[str, dict[str, bytearray]]]:
    """The object files a power cut after change ``k`` may have left: everything up to the
    last barrier, then none, all, or ``subsets`` random subsets of what followed."""
    barrier = max((i for i in range(k) if log[i].kind == "syncfs"), default=-1)
    base: dict[str, bytearray] = {}
    for c in log[:barrier + 1]:
        _apply(base, c)
    after = [c for c in log[barrier + 1:k] if c.kind not in ("syncfs", "fsync")]
    choices = [("none", []), ("all", after)]
    for n in range(subsets if len(after) > 1 else 0):
        choices.append((f"subset{n}", [c for c in after if rng.random() < 0.5]))
    for name, changes in choices:
        files = {p: bytearray(b) for p, b in base.items()}
        for c in changes:
            _apply(files, c)
        yield name, files


@dataclass
class Verdict:
    states: int = 0
    failures: list[str] = field(default_factory=list)


def check_states(rec: Recording, work: Path, page_size: int, points: int | None = None,
                 subsets: int = 2, seed: int = 7) -> Verdict:
    """Every crash state at ``points`` log positions (all of them if None, else evenly
    spread), as the module doc says; what failed, and how many states were checked."""
    rng = random.Random(seed)
    verdict = Verdict()
    n = len(rec.log)
    ks = range(n + 1) if points is None or points > n else sorted(
        {round(i * n / (points - 1)) for i in range(points)})
    for k in ks:
        durable = [s for s in rec.index if s.at <= k and s.durable]
        committed = [s for s in rec.index if s.at <= k]
        if not durable:
            continue
        indexes = {durable[-1].copy: "durable", committed[-1].copy: "committed"}
        acked = {rid for at, rid in rec.acked if at <= k}
        acked -= {rid for at, rid in rec.evicted if at <= k}
        for files_name, files in file_states(rec.log, k, rng, subsets):
            for copy, index_name in indexes.items():
                verdict.states += 1
                problem = _check_one(work, files, copy, acked, page_size)
                if problem:
                    verdict.failures.append(f"after change {k} ({rec.log[k - 1].kind if k else '-'}"
                                            f"), files {files_name}, index {index_name}: "
                                            f"{problem}")
    return verdict


def _rows_without_bytes(rank: Path) -> list[str]:
    conn = sqlite3.connect(f"file:{rank / 'index.sqlite'}?mode=ro", uri=True)
    try:
        rows = conn.execute(
            "SELECT key, generation, bytes, file_key, file_offset FROM objects").fetchall()
    finally:
        conn.close()
    lost = []
    for key, generation, nbytes, file_key, offset in rows:
        try:
            fd = os.open(rank / "objects" / fanout(file_key or key), os.O_RDONLY)
        except FileNotFoundError:
            lost.append(key)
            continue
        try:
            verify_file(FileOps(), fd, key, generation, nbytes, file_key, offset)
        except (OSError, ObjectCorrupt):
            lost.append(key)
        finally:
            os.close(fd)
    return lost


def _check_one(work: Path, files: dict[str, bytearray], index_copy: Path,
               acked: set[str], page_size: int) -> str | None:
    store_dir = work / "state"
    shutil.rmtree(store_dir, ignore_errors=True)
    work.mkdir(exist_ok=True)
    rank = store_dir / "rank-0"
    with PageStore(store_dir, 0, lease_seconds=0):
        pass  # the store's directories, as it makes them
    for name in os.listdir(rank):
        if name.startswith("index.sqlite"):
            os.unlink(rank / name)
    shutil.copyfile(index_copy, rank / "index.sqlite")
    (rank / "index.sqlite").chmod(0o600)
    for path, data in files.items():
        target = rank / path
        target.parent.mkdir(exist_ok=True)
        target.parent.chmod(0o700)
        fd = os.open(target, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    try:
        # Before any repair: no row names a file or record that is not there and whole
        # (files no row names are what a crash may leave, young here: the grace spares
        # them).
        report = fsck(store_dir, grace_seconds=3600)
        if not report.ok:
            return f"fsck before repair: {report.problems[:3]}"
        # Nor does a row of garbage (refcount 0): nothing is freed before the deletion that
        # freed it is durable, or a commit that deduplicates against the row brought back
        # names bytes that are gone (docs/store.md, "Recovery").
        lost = _rows_without_bytes(rank)
        if lost:
            return f"rows whose bytes are gone: {lost[:3]}"
        with PageStore(store_dir, 0, lease_seconds=0) as store:
            store.reconcile(grace_seconds=0)
            report = fsck(store_dir, grace_seconds=0)
            if not report.ok:
                return f"fsck: {report.problems[:3]}"
            roots = {rid: [k for (k,) in store._rconn.execute(
                "SELECT key FROM root_pages WHERE root_id = ? ORDER BY pos", (rid,))]
                for (rid,) in store._rconn.execute("SELECT id FROM roots")}
            for rid in acked:
                if rid not in roots:
                    return f"acknowledged root {rid} is gone"
            for rid, keys in roots.items():
                bufs = [bytearray(page_size) for _ in keys]
                got = store.restore(keys, bufs)
                if got != len(keys):
                    return f"root {rid} restores {got} of {len(keys)} pages"
                for key, buf in zip(keys, bufs, strict=True):
                    if bytes(buf) != page_bytes(key, page_size):
                        return f"root {rid}: page {key} restored wrong bytes"
    except Exception as exc:  # a state the store cannot open is a failure too
        return f"{type(exc).__name__}: {exc}"
    return None

