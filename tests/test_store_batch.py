"""Publications committed as one (``PageStore.commit_batch``): one sync and one index
transaction for all of them, in their order, a later one relying on what an earlier one
wrote; all or none."""

from __future__ import annotations

import secrets
import sqlite3
import time
from pathlib import Path

import pytest
from sparkcache.workers.commit import _GuardedOps

from sparkcache.store import CommitFailed, PageData, PageStore, Publication, Root, index
from sparkcache.store.checkpointer import INTERVAL_S
from sparkcache.store.fsck import fsck
from sparkcache.store.testing import FaultyFileOps, make_root, page_bytes

SIZE = 4096


def keys(n: int) -> list[str]:
    return [secrets.token_hex(16) for _ in range(n)]


def new_id() -> str:
    return secrets.token_hex(16)


def stored_roots(store: PageStore) -> dict[str, list[str]]:
    roots: dict[str, list[str]] = {}
    for root_id, key in store._rconn.execute(
            "SELECT root_id, key FROM root_pages ORDER BY root_id, pos"):
        roots.setdefault(root_id, []).append(key)
    return roots


def restores(store: PageStore, ks: list[str]) -> bool:
    bufs = [bytearray(SIZE) for _ in ks]
    return (store.restore(ks, bufs) == len(ks)
            and [bytes(b) for b in bufs] == [page_bytes(k, SIZE) for k in ks])


def object_files(store_dir: Path) -> set[Path]:
    return {p for p in (store_dir / "rank-0" / "objects").rglob("*") if p.is_file()}


class CountingOps(FaultyFileOps):
    """Counts the files a commit creates and the bytes it writes, beside its syncs."""

    def __init__(self) -> None:
        super().__init__()
        self.renames = 0
        self.bytes = 0

    def write(self, fd: int, pieces: list[memoryview]) -> int:
        n = super().write(fd, pieces)
        self.bytes += n
        return n

    def rename(self, *args, **kwargs) -> None:
        self.renames += 1
        super().rename(*args, **kwargs)


@pytest.fixture
def ops() -> CountingOps:
    return CountingOps()


@pytest.fixture
def store(tmp_path: Path, ops: CountingOps) -> PageStore:
    s = PageStore(tmp_path / "store", 0, lease_seconds=10, fileops=ops)
    yield s
    s.close()


def transactions(store: PageStore) -> list[str]:
    """Every write transaction the store begins from now on, as it begins."""
    begun: list[str] = []
    store._wconn.set_trace_callback(
        lambda sql: begun.append(sql) if sql.startswith("BEGIN") else None)
    return begun


def test_a_batch_commits_with_one_sync_and_one_transaction_in_order(
        store: PageStore, ops: CountingOps, tmp_path: Path) -> None:
    earlier = keys(4)
    store.commit(make_root(new_id(), earlier, SIZE))
    syncs, renames, written = ops.filesystem_syncs, ops.renames, ops.bytes
    begun = transactions(store)
    # A conversation's next two turns (the second relies on pages the first writes), a
    # publication in two parts (the part staged, then its root), and a new conversation.
    turn1 = earlier + keys(2)
    turn2 = turn1 + keys(3)
    part = keys(5)
    whole = part + keys(2)
    fresh = keys(3)
    batch = [Publication(make_root(new_id(), turn1, SIZE)),
             Publication(make_root(new_id(), turn2, SIZE)),
             Publication(make_root(new_id(), part, SIZE), place=False),
             Publication(make_root(new_id(), whole, SIZE)),
             Publication(make_root(new_id(), fresh, SIZE))]
    results = store.commit_batch(batch)
    assert ops.filesystem_syncs - syncs == 1
    assert len(begun) == 1
    assert [r.root_id for r in results] == [p.root.root_id for p in batch]
    # Each page written once, by the first publication that has it.
    assert [r.pages_written for r in results] == [2, 3, 5, 2, 3]
    assert ops.renames - renames == 5
    assert ops.bytes - written < 16 * (SIZE + 4096)  # headers and padding: < a page each
    roots = stored_roots(store)
    assert sorted(map(len, roots.values())) == [3, 7, 9]
    assert turn2 in roots.values() and whole in roots.values() and fresh in roots.values()
    for ks in (turn2, whole, fresh):
        assert restores(store, ks)
    assert fsck(tmp_path / "store", grace_seconds=0).ok


def test_a_batch_is_all_or_none(tmp_path: Path) -> None:
    """A publication that cannot be stored (here: a page capture never copied, whose
    stored copy is gone) fails the batch whole: none of it is visible, every file it
    wrote is gone, and what was stored before is as it was."""
    guarded = _GuardedOps()
    store_dir = tmp_path / "store"
    with PageStore(store_dir, 0, lease_seconds=10, fileops=guarded) as store:
        before = keys(3)
        store.commit(make_root(new_id(), before, SIZE))
        files = object_files(store_dir)
        guard = guarded.ensure(SIZE)
        good = Publication(make_root(new_id(), keys(4), SIZE))
        bad = Publication(Root(new_id(), [PageData(k, guard) for k in keys(2)]))
        with pytest.raises(CommitFailed, match="not captured"):
            store.commit_batch([good, bad])
        assert list(stored_roots(store).values()) == [before]
        assert object_files(store_dir) == files
        assert store.lookup([p.key for p in good.root.pages]) == 0
        # The good one alone, after: stored.
        store.commit_batch([good])
        assert restores(store, [p.key for p in good.root.pages])
        assert restores(store, before)
    assert fsck(store_dir, grace_seconds=0).ok


def test_publications_that_come_meanwhile_join_the_batch(
        store: PageStore, ops: CountingOps) -> None:
    first, second = keys(2), keys(3)
    third = second + keys(1)  # the next turn of the one that came meanwhile
    arriving = [[Publication(make_root(new_id(), second, SIZE))],
                [Publication(make_root(new_id(), third, SIZE))], []]
    asked = []

    def more() -> list[Publication]:
        asked.append(len(arriving))
        return arriving.pop(0) if arriving else []

    syncs = ops.filesystem_syncs
    begun = transactions(store)
    results = store.commit_batch([Publication(make_root(new_id(), first, SIZE))], more)
    assert len(results) == 3 and asked == [3, 2, 1]
    assert [r.pages_written for r in results] == [2, 3, 1]
    assert ops.filesystem_syncs - syncs == 1 and len(begun) == 1
    assert sorted(stored_roots(store).values()) == sorted([first, third])
    assert restores(store, first) and restores(store, third)


def test_a_workers_store_leaves_checkpoints_to_its_thread(tmp_path: Path) -> None:
    """With ``checkpoint_thread`` its COMMITs never checkpoint (SQLite's would, inside a
    commit of a few hundred pages); its thread copies the WAL into the index soon after,
    once every ``INTERVAL_S`` however many commits come."""
    with PageStore(tmp_path / "plain", 0) as plain:
        assert plain._wconn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 1000
    with PageStore(tmp_path / "s", 0, checkpoint_thread=True) as store:
        assert store._wconn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
        index_file = store.layout.index_path
        before = index_file.stat().st_size
        started = time.monotonic()
        for _ in range(6):
            store.commit(make_root(new_id(), keys(400), 64))
        deadline = time.monotonic() + 10
        while ((index_file.stat().st_size == before or not store._checkpointer.checkpoints)
               and time.monotonic() < deadline):
            time.sleep(0.01)
        assert index_file.stat().st_size > before  # the rows reached the index file
        ran = store._checkpointer.checkpoints
        assert 1 <= ran <= 2 + (time.monotonic() - started) / INTERVAL_S


def test_a_failed_fsync_at_a_background_checkpoint_stops_commits(tmp_path: Path) -> None:
    """As at a COMMIT (docs/store.md, "A failed fsync of the index"): nothing is
    acknowledged after it, and the error says why (the commit worker stops on it)."""
    with PageStore(tmp_path / "s", 0, checkpoint_thread=True) as store:
        store.commit(make_root(new_id(), keys(2), SIZE))
        failure = sqlite3.OperationalError("disk I/O error")
        failure.sqlite_errorcode = sqlite3.SQLITE_IOERR_FSYNC
        store._checkpointer.failure = failure
        with pytest.raises(CommitFailed, match="checkpoint") as caught:
            store.commit(make_root(new_id(), keys(2), SIZE))
        assert index.sync_failed(caught.value)
