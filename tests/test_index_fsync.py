"""An fsync of the index that fails stops acknowledgements (docs/store.md, "A failed
fsync of the index"): SQLite's own at a COMMIT, for real, through a disk that drops the
WAL's writes (``failing_fsync.c``, preloaded into a real supervisor); and the store's
own fsync of the WAL (``index.sync_wal``), which is never tried again."""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest
from eviction_util import meter
from pipeline_util import make_cfg, runtime, start_supervisor, stop_supervisor, wait_for

from sparkcache.store import PageStore
from sparkcache.store.fsck import fsck
from sparkcache.store.index import IndexSyncFailed, OutcomeUnknown, sync_failed
from sparkcache.store.testing import make_root
from sparkcache.synthetic import SyntheticEngine

HERE = Path(__file__).resolve().parent


def test_a_failed_fsync_is_told_from_other_commit_failures_through_the_causes() -> None:
    failed = sqlite3.OperationalError("disk I/O error")
    failed.sqlite_errorcode = 1034  # SQLITE_IOERR_FSYNC
    other = sqlite3.OperationalError("disk I/O error")
    other.sqlite_errorcode = 778  # SQLITE_IOERR_WRITE
    try:
        try:
            raise failed
        except sqlite3.Error as exc:
            raise OutcomeUnknown("index COMMIT failed") from exc
    except OutcomeUnknown as exc:
        assert sync_failed(exc)
    assert sync_failed(IndexSyncFailed("x")) and not sync_failed(other)
    assert not sync_failed(OutcomeUnknown("index COMMIT failed")) and not sync_failed(None)
    # A chain of contexts that loops is walked once (it once looped here for good).
    a, b = OutcomeUnknown("a"), OutcomeUnknown("b")
    a.__context__, b.__context__ = b, a
    assert not sync_failed(a)


def test_the_wal_fsync_that_failed_is_an_index_sync_failure_and_stops_collection(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Collection's deletions are synced after the slice (``sync_collected``); one whose
    fsync failed was tried again at the next slice, which could succeed with the pages
    the disk dropped marked clean, and then the files of rows a power cut may bring back
    were unlinked. Now the failure stops the worker and nothing is unlinked."""
    with PageStore(tmp_path / "store", 0, lease_seconds=0) as store:
        root = make_root(os.urandom(16).hex(), [os.urandom(16).hex()], 4096)
        store.commit(root)
        files = sorted(store.layout.objects_dir.rglob("*.*"))
        store.remove_roots([root.root_id])  # its object is collectable
        real = os.fdatasync

        def failing(fd: int) -> None:
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(os, "fdatasync", failing)
        assert store.collect(16, meter()).objects == 0  # rows deleted unsynced
        with pytest.raises(IndexSyncFailed, match="nothing more is acknowledged"):
            store.sync_collected()
        monkeypatch.setattr(os, "fdatasync", real)
        assert files and all(f.exists() for f in files)


def build_shim(tmp_path: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler for the failing-fsync shim")
    shim = tmp_path / "failing_fsync.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(shim),
                    str(HERE / "failing_fsync.c"), "-ldl"], check=True)
    return shim


def test_a_commit_whose_index_fsync_fails_is_not_acknowledged_and_commit_stops(
        tmp_path: Path, instance: str) -> None:
    """A real supervisor whose processes see a disk that drops the WAL's writes once a
    trigger file exists: the publication that met it is never acknowledged, the commit
    worker stops (FATAL, logged with what to do) rather than acknowledge later commits
    whose fsyncs may succeed; a restart on a sound disk serves what was stored and
    stores again."""
    shim = build_shim(tmp_path)
    trigger = tmp_path / "fail-fsync"
    store = tmp_path / "store"
    env = {"LD_PRELOAD": str(shim), "SPARKCACHE_TEST_FAIL_FSYNC": str(trigger)}
    sup = start_supervisor(store, instance, env=env)
    try:
        engine = SyntheticEngine.create(make_cfg(store, instance))
        try:
            page = engine.client.cfg.page_tokens
            first = list(range(8 * page))
            assert engine.publish("first", first)
            engine.drain(timeout=60)
            assert "first" in engine.acknowledged
            trigger.touch()
            assert engine.publish("second", list(range(10_000, 10_000 + 8 * page)))
            commit = wait_for(lambda: next(
                (w for w in runtime(store)["workers"]
                 if w["role"] == "commit" and w["state"] == "FATAL"), None),
                60, "the commit worker to stop")
            assert commit["last_exit"] == 4
            engine.drain(timeout=5)
            assert "second" not in engine.acknowledged
        finally:
            engine.close()
    finally:
        code, log = stop_supervisor(sup)
    assert code == 0, log[-3000:]
    assert "an fsync of the index failed at a COMMIT" in log, log[-3000:]
    assert "nothing more is acknowledged" in log
    trigger.unlink()
    sup = start_supervisor(store, instance)
    try:
        engine = SyntheticEngine.create(make_cfg(store, instance))
        try:
            assert engine.restore_exact(first) == (8, 8)
            assert engine.publish("third", list(range(20_000, 20_000 + 8 * page)))
            engine.drain(timeout=60)
            assert "third" in engine.acknowledged
        finally:
            engine.close()
    finally:
        code, log = stop_supervisor(sup)
    assert code == 0, log[-3000:]
    assert fsck(store).ok
