"""A commit makes its pages durable with a bounded number of syncs, in protocol order, and
fails cleanly when making them durable fails."""

from __future__ import annotations

import errno
import os
import secrets
import stat
import threading
from pathlib import Path

import pytest

from sparkcache.store import CommitFailed, PageStore
from sparkcache.store import durability as dur
from sparkcache.store.objects import WRITE_CHUNK_BYTES, record_span
from sparkcache.store.testing import FaultyFileOps, make_root, page_bytes

SIZE = 4096
BIG = 512 * 1024  # 30 pages make a pack of several write chunks


def keys(n: int) -> list[str]:
    return [secrets.token_hex(16) for _ in range(n)]


def object_files(store: PageStore) -> list[Path]:
    return sorted(p for p in store.layout.objects_dir.rglob("*") if p.is_file())


def restores(store: PageStore, page_keys: list[str]) -> bool:
    bufs = [bytearray(SIZE) for _ in page_keys]
    return store.restore(page_keys, bufs) == len(page_keys) and all(
        bytes(b) == page_bytes(k, SIZE) for b, k in zip(bufs, page_keys, strict=True)
    )


@pytest.mark.parametrize("pages", [1, 64, 700])
def test_a_commit_costs_one_filesystem_sync_whatever_its_size(
    tmp_path: Path, pages: int
) -> None:
    ops = FaultyFileOps()
    with PageStore(tmp_path / "s", 0, fileops=ops) as store:
        page_keys = keys(pages)
        store.commit(make_root(secrets.token_hex(16), page_keys, SIZE))
        # One syncfs makes files and names durable: no file or directory fsync at all.
        assert (ops.fsyncs, ops.filesystem_syncs) == (0, 1)
        assert restores(store, page_keys)
        # Pages the store already holds are not written again, nor synced.
        ops.filesystem_syncs = 0
        store.commit(make_root(secrets.token_hex(16), page_keys, SIZE))
        assert (ops.fsyncs, ops.filesystem_syncs) == (0, 0)


def test_without_syncfs_error_reports_the_file_and_its_directory_are_fsynced(
    tmp_path: Path,
) -> None:
    ops = FaultyFileOps(per_file_sync=True)
    with PageStore(tmp_path / "s", 0, fileops=ops) as store:
        page_keys = keys(40)
        store.commit(make_root(secrets.token_hex(16), page_keys, SIZE))
        assert ops.filesystem_syncs == 0
        assert ops.fsyncs == 2  # the pack of 40 pages, then its fan-out directory
        assert restores(store, page_keys)


class Recording(FaultyFileOps):
    """Records the calls that move a commit's files towards durability, in order."""

    def __init__(self, per_file_sync: bool) -> None:
        super().__init__(per_file_sync=per_file_sync)
        self.events: list[str] = []
        self.writebacks: list[tuple[int, int]] = []

    def write(self, fd: int, pieces: list[memoryview]) -> int:
        self.events.append("write")
        return super().write(fd, pieces)

    def start_writeback(self, fd: int, offset: int, nbytes: int) -> None:
        self.events.append("start_writeback")
        self.writebacks.append((offset, nbytes))
        super().start_writeback(fd, offset, nbytes)

    def rename(self, src: str, dst: str, src_dir_fd: int, dst_dir_fd: int) -> None:
        self.events.append("rename")
        super().rename(src, dst, src_dir_fd, dst_dir_fd)

    def sync_filesystem(self, fd: int) -> None:
        self.events.append("syncfs")
        super().sync_filesystem(fd)

    def fsync(self, fd: int) -> None:
        kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        self.events.append(f"fsync {kind}")
        super().fsync(fd)


@pytest.mark.parametrize("per_file_sync", [False, True], ids=["syncfs", "fsync-each"])
def test_every_page_is_durable_before_the_index_transaction_commits(
    tmp_path: Path, per_file_sync: bool
) -> None:
    ops = Recording(per_file_sync)
    with PageStore(tmp_path / "s", 0, fileops=ops, hook=ops.events.append) as store:
        # The transaction is built while the files sync, and commits after.
        store._wconn.set_trace_callback(
            lambda sql: ops.events.append(sql) if sql in ("BEGIN IMMEDIATE", "COMMIT") else None)
        page_keys = keys(30)
        store.commit(make_root(secrets.token_hex(16), page_keys, BIG))
        size = sum(f.stat().st_size for f in object_files(store))
    ev = ops.events
    first = {e: ev.index(e) for e in ev}
    last = {e: len(ev) - 1 - ev[::-1].index(e) for e in ev}
    # Each chunk's writeback starts as soon as it is written, before the next chunk: the
    # ranges tile the file in order, a chunk no longer than WRITE_CHUNK_BYTES and a page.
    spans = ops.writebacks
    assert len(spans) == ev.count("commit.written") > 1
    assert [at for at, _ in spans] == [sum(n for _, n in spans[:i]) for i in range(len(spans))]
    assert sum(n for _, n in spans) == size
    assert all(n < WRITE_CHUNK_BYTES + record_span(BIG) for _, n in spans)
    writebacks = [i for i, e in enumerate(ev) if e == "start_writeback"]
    assert all("write" in ev[a + 1:b] for a, b in zip([-1, *writebacks], writebacks, strict=False))
    assert last["write"] < last["start_writeback"] < first["rename"]
    assert ev.count("rename") == 1  # one pack
    if per_file_sync:
        assert "syncfs" not in ev and ev.count("fsync file") == ev.count("fsync dir") == 1
        assert last["rename"] < first["fsync file"] < first["fsync dir"]
        synced = first["fsync dir"]
    else:
        assert ev.count("syncfs") == 1 and not any(e.startswith("fsync") for e in ev)
        assert last["rename"] < first["syncfs"]
        synced = first["syncfs"]
    assert last["rename"] < first["commit.syncing"] < first["BEGIN IMMEDIATE"]
    assert synced < first["commit.durable"] < first["COMMIT"]
    assert first["BEGIN IMMEDIATE"] < first["commit.index_txn"] < first["commit.durable"]


def test_a_failed_writeback_start_fails_the_commit_cleanly(tmp_path: Path) -> None:
    class WritebackFails(FaultyFileOps):
        def start_writeback(self, fd: int, offset: int, nbytes: int) -> None:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    with PageStore(tmp_path / "s", 0, fileops=WritebackFails()) as store:
        page_keys = keys(3)
        with pytest.raises(CommitFailed, match="Input/output error"):
            store.commit(make_root(secrets.token_hex(16), page_keys, SIZE))
        assert object_files(store) == []
        assert store.usage().entries == 0 and store.lookup(page_keys) == 0


def test_syncfs_failure_is_raised(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    os.close(fd)
    with pytest.raises(OSError) as exc:
        dur.sync_filesystem(fd)  # a closed descriptor: the return value is checked
    assert exc.value.errno == errno.EBADF
    with pytest.raises(OSError) as exc:
        dur.start_writeback(fd)
    assert exc.value.errno == errno.EBADF


def test_writeback_start_where_unsupported_is_no_error() -> None:
    read, write = os.pipe()  # sync_file_range on a pipe: ESPIPE, only a hint lost
    try:
        dur.start_writeback(write)
    finally:
        os.close(read)
        os.close(write)


def test_kernel_version() -> None:
    assert dur.kernel_version("6.8.0-45-generic") == (6, 8)
    assert dur.kernel_version("5.4.0") == (5, 4) < (5, 8)
    assert dur.kernel_version("weird") == (0, 0)


def test_the_checksum_thread_ends_with_the_store(tmp_path: Path) -> None:
    def checksummers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("sparkcache-crc")]

    before = checksummers()
    store = PageStore(tmp_path / "s", 0)
    page_keys = keys(8)
    store.commit(make_root(secrets.token_hex(16), page_keys, SIZE))
    assert restores(store, page_keys)
    assert len(checksummers()) == len(before) + 1
    store.close()
    assert checksummers() == before
