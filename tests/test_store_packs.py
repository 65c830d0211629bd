"""Packs: a publication's new pages in one file, one record each (docs/store.md, "Packs").

A commit of several new pages writes one pack; records are block-aligned; a restore reads
a pack front to back through one descriptor; collecting part of a pack frees exactly
its records' blocks once a delay is over, and the last record removes the file; a damaged
record is quarantined alone; what a crash leaves between a row's deletion and the punch,
reconcile frees; a vanished pack makes its records misses; an index of version 1 is
upgraded in place.
"""

from __future__ import annotations

import os
import secrets
import sqlite3
import time
from pathlib import Path

import pytest
from eviction_util import FakeClock

from sparkcache.maintenance_policy import CostModel, SliceBudget, SliceMeter
from sparkcache.store import PageStore, StoreError, index
from sparkcache.store.eviction import ROW
from sparkcache.store.fileops import FileOps
from sparkcache.store.fsck import fsck
from sparkcache.store.objects import HEADER_SIZE, RECORD_ALIGN, record_span
from sparkcache.store.reader import StoreReader
from sparkcache.store.store import PUNCH_DELAY_S
from sparkcache.store.testing import make_root, object_file, page_bytes

SIZE = 3 * 4096 + 100  # a page whose record does not end on a block: padding is written


def keys(n: int) -> list[str]:
    return [secrets.token_hex(16) for _ in range(n)]


def rid() -> str:
    return secrets.token_hex(16)


def files(store: PageStore) -> list[Path]:
    return sorted(p for p in store.layout.objects_dir.rglob("*") if p.is_file())


def restored(store: PageStore, page_keys: list[str]) -> list[bytes]:
    bufs = [bytearray(SIZE) for _ in page_keys]
    n = store.restore(page_keys, bufs)
    return [bytes(b) for b in bufs[:n]]


def data_blocks(path: Path) -> int:
    """4 KiB blocks of ``path`` holding data, its holes excluded (from SEEK_DATA and
    SEEK_HOLE, not ``st_blocks``, which counts the filesystem's own extent blocks too)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size, at, data = os.fstat(fd).st_size, 0, 0
        while at < size:
            try:
                start = os.lseek(fd, at, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole from here on
                break
            at = os.lseek(fd, start, os.SEEK_HOLE)
            data += at - start
        return data // 4096
    finally:
        os.close(fd)


def assert_clean(store_dir: Path) -> None:
    report = fsck(store_dir, grace_seconds=0)
    assert report.ok, report.problems


@pytest.fixture
def clock() -> FakeClock:
    """The store's wall clock, moved by hand (leases, and the delay before a punch)."""
    return FakeClock(now=1_000_000.0)


@pytest.fixture
def store(tmp_path: Path, clock: FakeClock):
    with PageStore(tmp_path / "s", 0, lease_seconds=0, clock=clock) as s:
        yield s


def punch_due(store: PageStore, clock: FakeClock) -> None:
    """Let the deferred punches fall due and run them (a collection with nothing else
    to collect does)."""
    clock.now += PUNCH_DELAY_S
    store.collect(100)


def test_a_publication_is_one_pack_of_block_aligned_records(store: PageStore) -> None:
    page_keys = keys(5)
    result = store.commit(make_root(rid(), page_keys, SIZE))
    assert result.pages_written == 5
    (pack,) = files(store)
    assert pack.name.startswith(page_keys[0])  # named after its first record
    rows = store._rconn.execute(
        "SELECT key, file_key, file_offset FROM objects ORDER BY file_offset").fetchall()
    assert [r[0] for r in rows] == page_keys
    assert {r[1] for r in rows} == {page_keys[0]}
    assert [r[2] for r in rows] == [i * record_span(SIZE) for i in range(5)]
    assert record_span(SIZE) % RECORD_ALIGN == 0 and record_span(SIZE) > HEADER_SIZE + SIZE
    assert pack.stat().st_size == 5 * record_span(SIZE)
    assert stat_mode(pack) == 0o600
    assert restored(store, page_keys) == [page_bytes(k, SIZE) for k in page_keys]
    # A single new page is an object file of its own, as it always was.
    single = keys(1)
    store.commit(make_root(rid(), single, SIZE))
    path, offset = object_file(store.layout.objects_dir, store._rconn, single[0])
    assert offset == 0 and path.stat().st_size == HEADER_SIZE + SIZE
    assert store._rconn.execute("SELECT file_key FROM objects WHERE key = ?",
                                single).fetchone() == (None,)
    assert_clean(store.layout.store_dir)


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


class CountingOps(FileOps):
    def __init__(self) -> None:
        self.opened: list[str] = []

    def open(self, name: str, flags: int, mode: int, dir_fd: int) -> int:
        self.opened.append(name)
        return super().open(name, flags, mode, dir_fd)


def test_a_restore_reads_a_pack_through_one_descriptor(tmp_path: Path) -> None:
    with PageStore(tmp_path / "s", 0) as store:
        first, second = keys(40), keys(24)
        store.commit(make_root(rid(), first, SIZE))
        store.commit(make_root(rid(), first + second, SIZE))  # a second turn: its own pack
    ops = CountingOps()
    reader = StoreReader(tmp_path / "s", 0, fileops=ops)
    try:
        bufs = [bytearray(SIZE) for _ in first + second]
        assert reader.restore(first + second, bufs).pages == 64
        assert [bytes(b) for b in bufs] == [page_bytes(k, SIZE) for k in first + second]
        assert len(ops.opened) == 2  # one open per pack, not one per page
        assert reader.read_ahead(reader.plan(first + second)) == 64 * SIZE
    finally:
        reader.close()


def test_collecting_part_of_a_pack_frees_its_records_and_the_last_removes_it(
        store: PageStore, clock: FakeClock) -> None:
    shared, own_a, own_b = keys(2), keys(6), keys(2)
    a, b = rid(), rid()
    store.commit(make_root(a, shared + own_a, SIZE))  # pack A: 8 records
    store.commit(make_root(b, shared + own_b, SIZE))  # pack B: its 2 new pages only
    pack_a = object_file(store.layout.objects_dir, store._rconn, shared[0])[0]
    full = data_blocks(pack_a)
    assert full == 8 * record_span(SIZE) // 4096
    store.remove_roots([a])
    assert store.collect(100).objects == 6  # own_a; shared lives on in B
    assert data_blocks(pack_a) == full  # punched only once the delay is over
    assert fsck(store.layout.store_dir, grace_seconds=0).unpunched_bytes == 6 * record_span(SIZE)
    clock.now += PUNCH_DELAY_S - 1
    store.collect(100)
    assert data_blocks(pack_a) == full
    punch_due(store, clock)
    assert pack_a.exists() and pack_a.stat().st_size == 8 * record_span(SIZE)
    assert data_blocks(pack_a) == 2 * record_span(SIZE) // 4096  # exactly the 6 freed
    assert restored(store, shared + own_b) == [page_bytes(k, SIZE) for k in shared + own_b]
    assert store.usage().used_bytes == 4 * SIZE
    assert_clean(store.layout.store_dir)
    store.remove_roots([b])
    assert store.collect(100).objects == 4
    assert files(store) == []  # the last record of each pack removed its file
    assert_clean(store.layout.store_dir)


def test_maintenance_slices_free_each_record_of_a_named_pack_and_a_whole_pack_once(
        store: PageStore, clock: FakeClock) -> None:
    """Maintenance's path (rows deleted in one slice, their deletion synced, the files
    in the next), which asks once per pack whether rows still name it."""
    shared, own_a, own_c = keys(2), keys(6), keys(5)
    a, c = rid(), rid()
    store.commit(make_root(a, shared + own_a, SIZE))  # pack A: 8 records
    store.commit(make_root(rid(), shared + keys(1), SIZE))  # keeps pack A named
    store.commit(make_root(c, own_c, SIZE))  # pack C: 5 records, all to go
    pack_a = object_file(store.layout.objects_dir, store._rconn, shared[0])[0]
    pack_c = object_file(store.layout.objects_dir, store._rconn, own_c[0])[0]
    store.remove_roots([a, c])

    costs, collected, slices = CostModel(), 0, 0
    while collected < 11:  # a slice learns each kind of work's cost on its first unit
        meter = SliceMeter(SliceBudget(16, 1 << 30, 60.0), costs, time.monotonic)
        collected += store.collect(100, meter).objects
        store.sync_collected()
        slices += 1
        assert slices < 10
    assert collected == 11 and not pack_c.exists()
    assert fsck(store.layout.store_dir, grace_seconds=0).unpunched_bytes == 6 * record_span(SIZE)
    punch_due(store, clock)
    assert data_blocks(pack_a) == 2 * record_span(SIZE) // 4096  # the shared two
    assert restored(store, shared) == [page_bytes(k, SIZE) for k in shared]
    assert_clean(store.layout.store_dir)


def test_a_long_dead_range_is_punched_a_piece_a_slice_within_its_byte_budget(
        store: PageStore, clock: FakeClock) -> None:
    """An evicted root's end can be gigabytes of one pack: a slice frees at most the bytes
    it has left, a piece at a time, and the next slice goes on from where the data
    starts; the store is consistent between any two, and the shared records survive."""
    shared, own = keys(2), keys(20)
    a = rid()
    store.commit(make_root(a, shared + own, SIZE))
    store.commit(make_root(rid(), shared + keys(1), SIZE))  # keeps pack A named
    pack_a = object_file(store.layout.objects_dir, store._rconn, shared[0])[0]
    store.remove_roots([a])
    assert store.collect(100).objects == 20
    clock.now += PUNCH_DELAY_S
    budget_bytes = 10 * 4096 + 100  # 2.5 records: not a whole number of them
    blocks, slices = data_blocks(pack_a), 0
    while store._deferred:
        meter = SliceMeter(SliceBudget(16, budget_bytes, 60.0), CostModel(), time.monotonic)
        store.collect(0, meter)
        slices += 1
        now_blocks = data_blocks(pack_a)
        assert 0 < blocks - now_blocks <= budget_bytes // 4096
        assert meter.bytes <= budget_bytes
        blocks = now_blocks
        report = fsck(store.layout.store_dir, grace_seconds=0)
        assert report.ok, report.problems
        assert report.unpunched_bytes == (blocks - 2 * record_span(SIZE) // 4096) * 4096
        assert slices < 100
    assert slices == -(-20 * record_span(SIZE) // (budget_bytes // 4096 * 4096))
    assert data_blocks(pack_a) == 2 * record_span(SIZE) // 4096  # the shared two
    assert restored(store, shared) == [page_bytes(k, SIZE) for k in shared]
    assert_clean(store.layout.store_dir)


def test_a_record_collected_after_it_was_planned_is_a_miss_not_damage(
        store: PageStore, clock: FakeClock) -> None:
    shared, own = keys(2), keys(3)
    old = rid()
    store.commit(make_root(old, shared + own, SIZE))
    store.commit(make_root(rid(), shared + keys(1), SIZE))  # keeps the pack named
    plan = store._reader.plan(shared + own)
    store.remove_roots([old])
    assert store.collect(100).objects == 3
    punch_due(store, clock)  # own's records punched: they read as zeros
    result = store._reader.read_planned(plan, [bytearray(SIZE) for _ in plan])
    assert (result.pages, result.bad) == (2, ())
    assert_clean(store.layout.store_dir)


def test_a_damaged_record_is_quarantined_alone_and_healed_by_the_next_commit(
        store: PageStore, clock: FakeClock) -> None:
    page_keys = keys(4)
    store.commit(make_root(rid(), page_keys, SIZE))
    pack, offset = object_file(store.layout.objects_dir, store._rconn, page_keys[2])
    generation = pack.name.split(".")[1]
    data = bytearray(pack.read_bytes())
    data[offset + HEADER_SIZE + 7] ^= 0x04
    pack.write_bytes(data)
    damaged = bytes(data[offset:offset + HEADER_SIZE + SIZE])
    assert len(restored(store, page_keys)) == 2
    kept = store.layout.quarantine_dir / f"{page_keys[2]}.{generation}"
    assert kept.read_bytes() == damaged  # the record, for forensics
    assert store.lookup(page_keys) == 2
    assert store.usage().by_state["quarantined"] == (1, SIZE)
    # The other records are untouched: the page after the damaged one restores alone.
    assert restored(store, page_keys[:2]) == [page_bytes(k, SIZE) for k in page_keys[:2]]
    punch_due(store, clock)
    assert data_blocks(pack) == 3 * record_span(SIZE) // 4096
    assert_clean(store.layout.store_dir)
    result = store.commit(make_root(rid(), page_keys, SIZE))
    assert result.pages_written == 1
    assert restored(store, page_keys) == [page_bytes(k, SIZE) for k in page_keys]
    assert_clean(store.layout.store_dir)


class PunchLost(FileOps):
    """A punch that never happens: what a crash between collection's delete and its
    punch leaves."""

    def punch_hole(self, fd: int, offset: int, length: int) -> bool:
        return True


def test_reconcile_frees_records_a_crash_left_in_a_pack(tmp_path: Path) -> None:
    store_dir = tmp_path / "s"
    shared, own = keys(3), keys(5)
    with PageStore(store_dir, 0, lease_seconds=0, fileops=PunchLost()) as store:
        old = rid()
        store.commit(make_root(old, shared + own, SIZE))
        store.commit(make_root(rid(), [*shared, *keys(1)], SIZE))
        store.remove_roots([old])
        assert store.collect(100).objects == 5
        pack = object_file(store.layout.objects_dir, store._rconn, shared[0])[0]
    report = fsck(store_dir, grace_seconds=0)  # close() punched, and the punch was lost
    assert report.ok and report.unpunched_bytes == 5 * record_span(SIZE)
    with PageStore(store_dir, 0) as store:
        assert store.reconcile(grace_seconds=0).pack_ranges_freed == 1  # five in a row
        assert data_blocks(pack) == 3 * record_span(SIZE) // 4096
        assert restored(store, shared) == [page_bytes(k, SIZE) for k in shared]
        assert store.reconcile(grace_seconds=0).pack_ranges_freed == 0
    assert_clean(store_dir)


def test_the_sweep_frees_files_and_ranges_only_once_their_deletion_is_durable(
        tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """Collection deletes rows in a transaction it syncs after the slice; a slice that
    raised before that sync (or a maintenance killed there) left deletions a power cut
    would undo, and the sweep punched their records and unlinked their packs: rows
    brought back naming zeros or nothing."""
    events: list[str] = []

    class Recorded(FileOps):
        def punch_hole(self, fd: int, offset: int, length: int) -> bool:
            events.append("punch")
            return super().punch_hole(fd, offset, length)

        def unlink(self, name: str, dir_fd: int) -> None:
            events.append("unlink")
            super().unlink(name, dir_fd)

    sync_wal = index.sync_wal
    monkeypatch.setattr(index, "sync_wal", lambda path: (events.append("sync"), sync_wal(path)))
    with PageStore(tmp_path / "s", 0, lease_seconds=0, clock=clock,
                   fileops=Recorded()) as store:
        shared, own, alone = keys(2), keys(6), keys(3)
        a, c = rid(), rid()
        store.commit(make_root(a, shared + own, SIZE))
        store.commit(make_root(rid(), shared + keys(1), SIZE))  # keeps pack A named
        store.commit(make_root(c, alone, SIZE))  # pack C: none of it stays
        pack_a = object_file(store.layout.objects_dir, store._rconn, shared[0])[0]
        pack_c = object_file(store.layout.objects_dir, store._rconn, alone[0])[0]
        store.remove_roots([a, c])
        costs = CostModel()
        costs.observe(ROW, 1, 1e-6)  # learnt: the slice deletes every row at once
        store.collect(100, SliceMeter(SliceBudget(16, 1 << 30, 60.0), costs, time.monotonic))
        assert store.unlinking.objects == 9  # deleted, not yet synced: the slice "raised"
        events.clear()
        # Grace 0: as a re-sweep long after, once the files' renewed times are old.
        swept = store.sweep([pack_c.parent.name, pack_a.parent.name], grace_seconds=0)
        assert (swept.pack_ranges_freed, swept.orphan_files_removed) == (1, 1)
        assert events[0] == "sync" and sorted(events[1:]) == ["punch", "unlink"]
        assert data_blocks(pack_a) == 2 * record_span(SIZE) // 4096
        assert not pack_c.exists()
        events.clear()
        swept = store.sweep([pack_a.parent.name, pack_c.parent.name], grace_seconds=0)
        assert (swept.pack_ranges_freed, swept.orphan_files_removed) == (0, 0)
        assert events == []  # nothing to free: no sync either


def test_a_vanished_pack_makes_its_records_misses(store: PageStore) -> None:
    page_keys = keys(6)
    store.commit(make_root(rid(), page_keys, SIZE))
    (pack,) = files(store)
    pack.unlink()
    assert restored(store, page_keys) == []
    assert store.counters.missing_files == 1  # the first page's read found it gone
    result = store.reconcile(grace_seconds=0)
    assert result.objects_missing == 5  # the rest
    assert store.lookup(page_keys) == 0
    assert_clean(store.layout.store_dir)
    store.commit(make_root(rid(), page_keys, SIZE))
    assert restored(store, page_keys) == [page_bytes(k, SIZE) for k in page_keys]


def test_a_symlink_planted_for_a_pack_is_never_followed(store: PageStore,
                                                        tmp_path: Path) -> None:
    page_keys = keys(3)
    store.commit(make_root(rid(), page_keys, SIZE))
    (pack,) = files(store)
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * (4 * record_span(SIZE)))
    pack.unlink()
    pack.symlink_to(secret)
    assert restored(store, page_keys) == []
    assert store.counters.quarantined == 1
    assert secret.read_bytes() == b"s" * (4 * record_span(SIZE))
    store.reconcile(grace_seconds=0)
    assert not pack.is_symlink() and secret.exists()
    assert store.lookup(page_keys) == 0
    assert_clean(store.layout.store_dir)


def test_a_page_another_committer_stored_first_is_punched_out_of_ours(
        tmp_path: Path) -> None:
    page_keys = keys(4)
    other = PageStore(tmp_path / "s", 0)

    def race(step: str) -> None:
        if step == "commit.syncing" and not raced:
            raced.append(other.commit(make_root(rid(), page_keys[1:3], SIZE)))

    raced: list[object] = []
    with PageStore(tmp_path / "s", 0, hook=race) as store:
        result = store.commit(make_root(rid(), page_keys, SIZE))
        assert raced and result.pages_written == 2  # the other two are theirs
        pack = object_file(store.layout.objects_dir, store._rconn, page_keys[0])[0]
        assert data_blocks(pack) == 2 * record_span(SIZE) // 4096
        assert restored(store, page_keys) == [page_bytes(k, SIZE) for k in page_keys]
    other.close()
    assert_clean(tmp_path / "s")


def downgrade_to_version_1(index_path: Path) -> None:
    """Make an index as version 1 of the schema left it (no pack columns)."""
    conn = sqlite3.connect(index_path, isolation_level=None)
    try:
        conn.execute("DROP INDEX objects_file")
        conn.execute("ALTER TABLE objects DROP COLUMN file_key")
        conn.execute("ALTER TABLE objects DROP COLUMN file_offset")
        conn.execute("UPDATE meta SET value = '1' WHERE name = 'schema_version'")
    finally:
        conn.close()


def test_an_index_of_version_1_is_upgraded_by_its_first_writer(tmp_path: Path) -> None:
    store_dir = tmp_path / "s"
    page_keys = keys(3)
    with PageStore(store_dir, 0) as store:
        for n in range(1, 4):  # a page a turn: object files, what version 1 wrote
            store.commit(make_root(rid(), page_keys[:n], SIZE))
        layout = store.layout
    downgrade_to_version_1(layout.index_path)
    with pytest.raises(StoreError, match="schema version 1, expected 2"):
        StoreReader(store_dir, 0)  # a reader never upgrades
    with PageStore(store_dir, 0) as store:
        assert store._rconn.execute(
            "SELECT value FROM meta WHERE name = 'schema_version'").fetchone() == ("2",)
        assert restored(store, page_keys) == [page_bytes(k, SIZE) for k in page_keys]
        more = keys(3)
        store.commit(make_root(rid(), page_keys + more, SIZE))  # a pack beside them
        assert restored(store, page_keys + more) == [
            page_bytes(k, SIZE) for k in page_keys + more]
    conn = index.connect(layout.index_path, create=True)  # a second writer: no-op
    conn.close()
    assert_clean(store_dir)
    assert os.path.exists(layout.index_path)


def test_collecting_a_quarantined_first_record_keeps_the_pack_its_siblings_are_in(
        store: PageStore) -> None:
    """A pack is named after its first record, with the pack's generation; quarantining
    that record leaves its row naming no pack, so the row looks like an object file of
    that very name. Collecting the row must not remove the pack while other rows (here
    unreferenced ones, which a commit may still rely on) name it."""
    page_keys = sorted(keys(4))  # the pack's key first in the garbage index's order too
    old = rid()
    store.commit(make_root(old, page_keys, SIZE))
    pack, offset = object_file(store.layout.objects_dir, store._rconn, page_keys[0])
    data = bytearray(pack.read_bytes())
    data[offset + HEADER_SIZE + 7] ^= 0x04
    pack.write_bytes(data)
    assert restored(store, page_keys) == []  # the first record quarantined
    store.remove_roots([old])
    assert store.collect(1).objects == 1  # the quarantined row alone
    assert pack.exists()  # the other three rows still name it
    # A commit of the same pages relies on the three rows it finds live.
    assert store.commit(make_root(rid(), page_keys, SIZE)).pages_written == 1
    assert restored(store, page_keys) == [page_bytes(k, SIZE) for k in page_keys]
    assert_clean(store.layout.store_dir)
