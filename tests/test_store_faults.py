"""Disk full, EIO on a sync and bit flips: failures are clean, corruption is always caught."""

from __future__ import annotations

import errno
import os
import random
import secrets
import stat
from pathlib import Path

import pytest

from sparkcache.store import CommitFailed, PageData, PageStore, Root, objects
from sparkcache.store.fileops import FileOps
from sparkcache.store.objects import HEADER_SIZE, split_pieces
from sparkcache.store.testing import FaultyFileOps, make_root, object_file, page_bytes

SIZE = 8192


def keys(n: int, prefix: str = "") -> list[str]:
    return [(prefix + secrets.token_hex(16))[:32] for _ in range(n)]


def files(store: PageStore) -> list[Path]:
    return sorted(p for p in store.layout.objects_dir.rglob("*") if p.is_file())


def restores(store: PageStore, page_keys: list[str]) -> bool:
    bufs = [bytearray(SIZE) for _ in page_keys]
    n = store.restore(page_keys, bufs)
    return n == len(page_keys) and all(
        bytes(b) == page_bytes(k, SIZE) for b, k in zip(bufs, page_keys, strict=True)
    )


def test_disk_full_fails_cleanly_and_recovers(tmp_path: Path) -> None:
    ops = FaultyFileOps()
    store = PageStore(tmp_path / "s", 0, fileops=ops)
    before = keys(3)
    store.commit(make_root(secrets.token_hex(16), before, SIZE))
    kept = files(store)
    ops.space = 2 * (SIZE + HEADER_SIZE) + 100  # room for two pages and a bit
    failed_root = secrets.token_hex(16)
    page_keys = keys(4)
    with pytest.raises(CommitFailed, match="No space left"):
        store.commit(make_root(failed_root, page_keys, SIZE))
    assert files(store) == kept  # partial and temporary files removed
    assert store.lookup(page_keys) == 0
    assert store.usage().entries == 1
    assert restores(store, before)
    ops.space = None  # space freed
    store.commit(make_root(failed_root, page_keys, SIZE))
    assert restores(store, page_keys)
    store.close()


@pytest.mark.parametrize("per_file_sync", [False, True], ids=["syncfs", "fsync-each"])
def test_eio_on_sync_fails_the_commit_and_is_not_retried(
    tmp_path: Path, per_file_sync: bool
) -> None:
    ops = FaultyFileOps(per_file_sync=per_file_sync)
    store = PageStore(tmp_path / "s", 0, fileops=ops)
    before = keys(2)
    store.commit(make_root(secrets.token_hex(16), before, SIZE))
    kept = files(store)
    ops.fail_sync = True
    ops.fsyncs = ops.filesystem_syncs = 0
    page_keys = keys(3)
    with pytest.raises(CommitFailed, match="Input/output error"):
        store.commit(make_root(secrets.token_hex(16), page_keys, SIZE))
    # One sync failed and the commit gave up: no second attempt on the same data.
    assert (ops.fsyncs, ops.filesystem_syncs) == ((1, 0) if per_file_sync else (0, 1))
    assert files(store) == kept
    assert store.lookup(page_keys) == 0
    assert store.counters.commits_failed == 1
    ops.fail_sync = False
    assert restores(store, before)
    store.commit(make_root(secrets.token_hex(16), page_keys, SIZE))
    assert restores(store, page_keys)
    store.close()


def test_eio_on_directory_fsync_leaves_nothing_referenced(tmp_path: Path) -> None:
    class DirFsyncFails(FaultyFileOps):
        def fsync(self, fd: int) -> None:
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            super().fsync(fd)

    # Only where syncfs cannot be trusted are directories fsynced one by one.
    store = PageStore(tmp_path / "s", 0, fileops=DirFsyncFails(per_file_sync=True))
    page_keys = keys(3)
    with pytest.raises(CommitFailed):
        store.commit(make_root(secrets.token_hex(16), page_keys, SIZE))
    assert files(store) == [] and store.usage().entries == 0
    store.close()


@pytest.mark.parametrize("flags", [objects.FLAG_CRC32C, 0], ids=["crc32c", "crc32"])
def test_a_thousand_bit_flips_are_all_detected(tmp_path: Path, monkeypatch, flags: int) -> None:
    """In objects of either checksum: CRC-32C, what is written now, and zlib's CRC-32,
    what stores written before hold."""
    monkeypatch.setattr(objects, "WRITE_FLAGS", flags)
    rng = random.Random(1234)
    store = PageStore(tmp_path / "s", 0)
    page_keys = keys(20)
    store.commit(make_root(secrets.token_hex(16), page_keys, SIZE))
    rows = {k: store._rconn.execute("SELECT file_key, file_offset FROM objects WHERE key = ?",
                                    (k,)).fetchone() for k in page_keys}
    (path,) = {object_file(store.layout.objects_dir, store._rconn, k)[0] for k in page_keys}
    original = path.read_bytes()  # one pack of 20 records
    assert {int.from_bytes(original[o + 12:o + 16], "little")
            for _, o in rows.values()} == {flags}
    assert restores(store, page_keys)
    misses = 0
    for _ in range(1000):
        key = rng.choice(page_keys)
        data = bytearray(original)
        bit = rows[key][1] * 8 + rng.randrange((HEADER_SIZE + SIZE) * 8)  # in its record
        data[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(data)
        buf = bytearray(SIZE)
        if store.restore([key], [buf]) == 0:
            misses += 1
            assert buf == bytes(SIZE)
        # Put the good pack back (quarantine punched the record out of it) and the row as
        # it was for the next round.
        path.write_bytes(original)
        with store._wconn as conn:
            conn.execute("UPDATE objects SET state = 'live', file_key = ?, file_offset = ? "
                         "WHERE key = ?", (*rows[key], key))
    assert misses == 1000
    assert store.counters.quarantined == 1000
    assert restores(store, page_keys)
    store.close()


def test_index_full_fails_cleanly_and_recovers(tmp_path: Path) -> None:
    store = PageStore(tmp_path / "s", 0)
    before = keys(2)
    store.commit(make_root(secrets.token_hex(16), before, SIZE))
    kept = files(store)
    pages = store._wconn.execute("PRAGMA page_count").fetchone()[0]
    store._wconn.execute(f"PRAGMA max_page_count = {pages}")  # SQLITE_FULL on growth
    page_keys = keys(200)
    with pytest.raises(CommitFailed, match="full"):
        store.commit(make_root(secrets.token_hex(16), page_keys, 64))
    assert files(store) == kept
    assert store.usage().entries == 1 and restores(store, before)
    store._wconn.execute("PRAGMA max_page_count = 1073741823")
    store.commit(make_root(secrets.token_hex(16), page_keys, 64))
    assert store.lookup(page_keys) == 200
    store.close()


def test_corruption_deep_in_a_long_restore_ends_the_prefix_there(tmp_path: Path) -> None:
    store = PageStore(tmp_path / "s", 0)
    page_keys = keys(12)
    store.commit(make_root(secrets.token_hex(16), page_keys, SIZE))
    victim, offset = object_file(store.layout.objects_dir, store._rconn, page_keys[7])
    data = bytearray(victim.read_bytes())
    data[offset + HEADER_SIZE + 5] ^= 0x10
    victim.write_bytes(data)
    bufs = [bytearray(SIZE) for _ in page_keys]
    assert store.restore(page_keys, bufs) == 7
    assert [bytes(b) for b in bufs[:7]] == [page_bytes(k, SIZE) for k in page_keys[:7]]
    assert bufs[7] == bytes(SIZE)
    assert store.counters.quarantined == 1
    assert store.lookup(page_keys) == 7
    store.close()


def test_a_truncated_object_is_never_restored(tmp_path: Path) -> None:
    store = PageStore(tmp_path / "s", 0)
    page_keys = keys(2)
    store.commit(make_root(secrets.token_hex(16), page_keys, SIZE))
    victim, offset = object_file(store.layout.objects_dir, store._rconn, page_keys[1])
    victim.write_bytes(victim.read_bytes()[: offset + HEADER_SIZE + SIZE // 2])
    bufs = [bytearray(SIZE), bytearray(b"\\xff" * SIZE)]
    assert store.restore(page_keys, bufs) == 1
    assert bufs[1] == bytearray(b"\\xff" * SIZE)  # rejected on size, before any read
    assert store.counters.quarantined == 1
    store.close()


def test_disk_full_inside_a_page_of_many_pieces(tmp_path: Path) -> None:
    """ENOSPC inside the pieces of a page fails the commit and leaves no file behind; a
    writev that writes less than asked, ending inside a piece, continues from there."""
    ops = ShortWrites()
    store = PageStore(tmp_path / "s", 0, fileops=ops)
    page_keys = keys(2)
    whole = [page_bytes(k, SIZE) for k in page_keys]
    root = Root(secrets.token_hex(16), [
        PageData(k, [memoryview(w)[i : i + 100] for i in range(0, SIZE, 100)])
        for k, w in zip(page_keys, whole, strict=True)
    ])
    ops.space = SIZE + HEADER_SIZE + 1234  # the second page stops mid-piece
    with pytest.raises(CommitFailed, match="No space left"):
        store.commit(root)
    assert files(store) == []
    ops.space = None
    store.commit(root)
    assert ops.calls > 2 * SIZE // ShortWrites.MOST
    assert restores(store, page_keys)
    store.close()


class ShortWrites(FaultyFileOps):
    """Writes at most ``MOST`` bytes per call, as a writev may."""

    MOST = 333

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def write(self, fd: int, pieces: list[memoryview]) -> int:
        self.calls += 1
        return super().write(fd, split_pieces(pieces, self.MOST)[0])


class FailsToOpen(FileOps):
    """Opens fail with ``errno`` while ``failing``: a descriptor table full, an I/O
    error; nothing about the object opened."""

    def __init__(self, error: int) -> None:
        self.error, self.failing = error, False

    def open(self, name: str, flags: int, mode: int, dir_fd: int) -> int:
        if self.failing:
            raise OSError(self.error, os.strerror(self.error))
        return super().open(name, flags, mode, dir_fd)


@pytest.mark.parametrize("error", [errno.EMFILE, errno.EIO])
def test_a_report_checked_again_through_a_failing_open_quarantines_nothing(
        tmp_path: Path, error: int) -> None:
    """A reader's report of damage is verified again before anything is quarantined; an
    error of that check that says nothing about the object quarantined a good one."""
    ops = FailsToOpen(error)
    store = PageStore(tmp_path / "s", 0, fileops=ops)
    page_keys = keys(3)
    store.commit(make_root(secrets.token_hex(16), page_keys, SIZE))
    generation = store._rconn.execute("SELECT generation FROM objects WHERE key = ?",
                                      (page_keys[1],)).fetchone()[0]
    ops.failing = True
    assert not store.verify_and_quarantine(page_keys[1], generation, "a reader's report")
    ops.failing = False
    assert store.counters.quarantined == 0 and restores(store, page_keys)
    store.close()


def test_a_stale_report_of_a_collected_object_quarantines_nothing(tmp_path: Path) -> None:
    """The report named an object collected since: its row is gone (its file may still
    wait for its unlink), so nothing is quarantined, counted or moved aside."""
    store = PageStore(tmp_path / "s", 0, lease_seconds=0)
    root, page_keys = secrets.token_hex(16), keys(2)
    store.commit(make_root(root, page_keys, SIZE))
    generation = store._rconn.execute("SELECT generation FROM objects WHERE key = ?",
                                      (page_keys[0],)).fetchone()[0]
    store.remove_roots([root])
    store.collect(10)
    store.quarantine(page_keys[0], generation, "a stale report")
    assert store.counters.quarantined == 0
    assert os.listdir(store.layout.quarantine_dir) == []
    store.close()
