"""Publications in parts (``PageStore.stage``): a part's pages are durable and invisible
until the publication's root commits, which adopts them without writing them again; held
from collection while a publication may still end, collected once their hold is over."""

from __future__ import annotations

import secrets
import sqlite3
from pathlib import Path

import pytest
from sparkcache.workers.commit import _GuardedOps

from sparkcache.store import CommitFailed, PageData, PageStore, Root, index
from sparkcache.store.fsck import fsck
from sparkcache.store.store import MIN_STAGE_HOLD_S
from sparkcache.store.testing import make_root, page_bytes

SIZE = 4096


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def keys(n: int) -> list[str]:
    return [secrets.token_hex(16) for _ in range(n)]


def restored(store: PageStore, ks: list[str]) -> list[bytes]:
    bufs = [bytearray(SIZE) for _ in ks]
    n = store.restore(ks, bufs)
    return [bytes(b) for b in bufs[:n]]


def pack_files(store_dir: Path) -> set[Path]:
    return {p for p in (store_dir / "rank-0" / "objects").rglob("*") if p.is_file()}


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> PageStore:
    s = PageStore(tmp_path / "store", 0, lease_seconds=10, clock=clock)
    yield s
    s.close()


def test_staged_parts_are_invisible_until_the_root_commits_and_are_not_written_again(
        store: PageStore) -> None:
    ks = keys(12)
    root_id = secrets.token_hex(16)
    first = store.stage(make_root(root_id, ks[:5], SIZE))
    second = store.stage(make_root(root_id, ks[5:9], SIZE))
    assert (first.pages_written, second.pages_written) == (5, 4)
    assert store.lookup(ks) == 0  # nothing of the publication is visible
    assert store.usage().used_bytes >= 9 * SIZE  # but counted against the cap
    # The last part: every page's entry, the staged ones without their bytes (commit
    # gives them as a guard that refuses to be written; here, bytes that are no page's).
    last = Root(root_id, [PageData(k, b"\xff" * SIZE) for k in ks[:9]]
                + make_root(root_id, ks[9:], SIZE).pages)  # \xff: would fail the restores
    result = store.commit(last)
    assert (result.pages, result.pages_written, result.pages_deduplicated) == (12, 3, 9)
    assert store.lookup(ks) == 12
    assert restored(store, ks) == [page_bytes(k, SIZE) for k in ks]
    assert store.counters.stages == 2 and store.counters.commits == 1
    assert fsck(store.layout.store_dir, 0).ok


def test_a_part_staged_again_writes_nothing(store: PageStore) -> None:
    """A commit worker killed after staging a part redoes its slot: nothing is written."""
    ks = keys(6)
    root_id = secrets.token_hex(16)
    store.stage(make_root(root_id, ks, SIZE))
    files = pack_files(store.layout.store_dir)
    again = store.stage(make_root(root_id, ks, SIZE))
    assert again.pages_written == 0
    assert pack_files(store.layout.store_dir) == files


def test_staged_pages_outlive_collection_while_held_then_go(store: PageStore,
                                                           clock: Clock) -> None:
    ks = keys(4)
    store.stage(make_root(secrets.token_hex(16), ks, SIZE))
    assert store.stage_hold_s == MIN_STAGE_HOLD_S  # the lease (10 s) is shorter
    clock.now += MIN_STAGE_HOLD_S - 1
    assert store.collect(100).objects == 0
    assert store.hold_staged(ks[1:], 30) == set(ks[1:])  # a later attempt holds them
    clock.now += 2  # the first page's hold is over; the others' runs 29 s more
    assert store.collect(100).objects == 1
    assert store.hold_staged(ks, 30) == set(ks[1:])
    clock.now += 31
    assert store.collect(100).objects == 3
    assert pack_files(store.layout.store_dir) == set()
    assert store.usage().used_bytes == 0
    assert fsck(store.layout.store_dir, 0).ok


def test_a_root_adopting_staged_pages_ends_their_hold(store: PageStore, clock: Clock) -> None:
    """Once the root holds them, its lease rules: removed within the hold, its pages are
    collected at once instead of counting in used bytes until the hold is over."""
    ks = keys(6)
    root_id = secrets.token_hex(16)
    store.stage(make_root(root_id, ks[:4], SIZE))
    store.commit(make_root(root_id, ks, SIZE))
    clock.now += 11  # the root's lease (10 s) is over, the staging hold (60 s) is not
    assert store.remove_roots([root_id]).removed == (root_id,)
    assert store.collect(100).objects == 6
    assert store.usage().used_bytes == 0
    assert fsck(store.layout.store_dir, 0).ok


def test_hold_staged_names_only_unreferenced_pages(store: PageStore) -> None:
    ks = keys(8)
    store.commit(make_root(secrets.token_hex(16), ks[:3], SIZE))
    store.stage(make_root(secrets.token_hex(16), ks[3:6], SIZE))
    assert store.hold_staged(ks, 30) == set(ks[3:6])
    assert store.hold_staged(ks[6:], 30) == set()
    with pytest.raises(ValueError, match="page key"):
        store.hold_staged(["not-hex"], 30)


def test_a_root_whose_staged_pages_were_collected_fails_rather_than_store_a_guard(
        store: PageStore, clock: Clock) -> None:
    """The publication's last part came after its staged pages were collected: the commit
    has no bytes for them and must fail, never store what it was given in their place."""
    ops = _GuardedOps()
    guarded = PageStore(store.layout.store_dir, 0, lease_seconds=10, clock=clock, fileops=ops)
    try:
        ks = keys(5)
        root_id = secrets.token_hex(16)
        guarded.stage(make_root(root_id, ks[:3], SIZE))
        clock.now += MIN_STAGE_HOLD_S + 1
        assert guarded.collect(100).objects == 3
        guard = ops.ensure(SIZE)
        last = Root(root_id, [PageData(k, guard) for k in ks[:3]]
                    + make_root(root_id, ks[3:], SIZE).pages)
        with pytest.raises(CommitFailed):
            guarded.commit(last)
        assert guarded.lookup(ks) == 0
    finally:
        guarded.close()


def test_an_index_made_before_holds_gains_the_column(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    PageStore(store_dir, 0).close()
    path = store_dir / "rank-0" / "index.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("ALTER TABLE objects DROP COLUMN hold_until")
    conn.close()
    with PageStore(store_dir, 0) as s:
        ks = keys(3)
        s.stage(make_root(secrets.token_hex(16), ks, SIZE))
        assert s.collect(100).objects == 0  # held
        cols = [r[1] for r in s._wconn.execute("PRAGMA table_info(objects)")]
        assert cols.count("hold_until") == 1
    assert index.SCHEMA_VERSION == "2"


def test_a_held_page_once_adopted_is_collected_at_once_when_its_root_goes(
        store: PageStore, clock: Clock) -> None:
    """The hold protects a page only while it waits for its root: a root evicted later
    frees it like any page (with the hold kept, eviction at the cap left it uncollected
    for the rest of the hold)."""
    ks = keys(4)
    root_id = secrets.token_hex(16)
    store.stage(make_root(root_id, ks[:3], SIZE))
    store.commit(make_root(root_id, ks, SIZE))
    clock.now += store.lease_seconds + 1  # the root's lease is over, the hold would not be
    assert store.remove_roots([root_id]).removed == (root_id,)
    assert store.collect(100).objects == 4
    assert store.usage().used_bytes == 0
