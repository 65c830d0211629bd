"""Restores past the page cache (``sparkcache.store.direct``): a cold run of a pack's
records is read with ``O_DIRECT`` into the reader's own buffers, verified there and
copied out byte-exact; a cached run is read through the page cache; a damaged record
stops the run with nothing of it copied; a record collected since it was planned is a
miss; a filesystem or device without ``O_DIRECT`` is read through the page cache; records
larger than a request are read one a request."""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

import pytest
from eviction_util import FakeClock

from sparkcache.filesystems import MEMORY_FILESYSTEMS, filesystem_of
from sparkcache.store import PageStore
from sparkcache.store.direct import REQUEST_BYTES, DirectReads, mostly_cached
from sparkcache.store.fileops import FileOps
from sparkcache.store.objects import HEADER_SIZE
from sparkcache.store.reader import StoreReader
from sparkcache.store.store import PUNCH_DELAY_S
from sparkcache.store.testing import evict_from_page_cache, make_root, object_file, page_bytes

SIZE = 3 * 4096 + 100  # records padded to the next block


def keys(n: int) -> list[str]:
    return [secrets.token_hex(16) for _ in range(n)]


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as ex:
        yield ex


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    if filesystem_of(tmp_path) in MEMORY_FILESYSTEMS:
        pytest.skip(f"{tmp_path} is in memory: no O_DIRECT, nothing to evict")
    return tmp_path


def packs(store_dir: Path) -> list[Path]:
    return sorted(p for p in (store_dir / "rank-0" / "objects").rglob("*.*") if p.is_file())


def cached(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        return mostly_cached(fd, 0, path.stat().st_size)
    finally:
        os.close(fd)


def direct_reader(store_dir: Path, pool: ThreadPoolExecutor,
                  fileops: FileOps | None = None) -> closing[StoreReader]:
    return closing(StoreReader(store_dir, 0, fileops=fileops, direct=DirectReads(pool)))


def test_a_cold_pack_is_read_past_the_page_cache_byte_exact(
        disk: Path, pool: ThreadPoolExecutor) -> None:
    first, second = keys(40), keys(24)
    with PageStore(disk / "s", 0) as store:
        store.commit(make_root(secrets.token_hex(16), first, SIZE))
        store.commit(make_root(secrets.token_hex(16), first + second, SIZE))  # its own pack
    evict_from_page_cache(disk / "s")
    with direct_reader(disk / "s", pool) as reader:
        bufs = [bytearray(SIZE) for _ in first + second]
        result = reader.restore(first + second, bufs)
        assert (result.pages, result.bad) == (64, ())
        assert [bytes(b) for b in bufs] == [page_bytes(k, SIZE) for k in first + second]
        # Both packs read past the page cache.
        assert (result.direct_bytes, result.cached_bytes, result.buffered_bytes) == (
            64 * SIZE, 0, 0)
        # Nothing was read into the page cache on the way.
        assert not any(cached(p) for p in packs(disk / "s"))
        # Into pieces, as a page goes into its KV blocks' runs.
        out = [bytearray(SIZE) for _ in first]
        pieces = [[memoryview(b)[:100], memoryview(b)[100:5000], memoryview(b)[5000:]]
                  for b in out]
        assert reader.read_planned(reader.plan(first), pieces).pages == 40
        assert [bytes(b) for b in out] == [page_bytes(k, SIZE) for k in first]


def test_a_cached_run_is_read_through_the_page_cache(
        disk: Path, pool: ThreadPoolExecutor) -> None:
    page_keys = keys(16)
    with PageStore(disk / "s", 0) as store:
        store.commit(make_root(secrets.token_hex(16), page_keys, SIZE))
    with direct_reader(disk / "s", pool) as reader:  # just committed: in the page cache
        bufs = [bytearray(SIZE) for _ in page_keys]
        result = reader.restore(page_keys, bufs)
        assert result.pages == 16
        assert [bytes(b) for b in bufs] == [page_bytes(k, SIZE) for k in page_keys]
        assert (result.direct_bytes, result.cached_bytes, result.buffered_bytes) == (
            0, 16 * SIZE, 0)


def test_a_damaged_record_stops_the_run_and_nothing_of_it_is_copied(
        disk: Path, pool: ThreadPoolExecutor) -> None:
    page_keys = keys(6)
    with PageStore(disk / "s", 0) as store:
        store.commit(make_root(secrets.token_hex(16), page_keys, SIZE))
        pack, offset = object_file(store.layout.objects_dir, store._rconn, page_keys[3])
    data = bytearray(pack.read_bytes())
    data[offset + HEADER_SIZE + 11] ^= 0x10
    pack.write_bytes(data)
    evict_from_page_cache(disk / "s")
    with direct_reader(disk / "s", pool) as reader:
        bufs = [bytearray(b"\xaa" * SIZE) for _ in page_keys]
        result = reader.restore(page_keys, bufs)
        assert result.pages == 3 and result.direct_bytes == 3 * SIZE
        assert [(b.key, b.reason) for b in result.bad] == [(page_keys[3], "checksum mismatch")]
        assert [bytes(b) for b in bufs[:3]] == [page_bytes(k, SIZE) for k in page_keys[:3]]
        assert bytes(bufs[3]) == bytes(SIZE)  # zeroed, as a buffered read leaves it
        assert all(bytes(b) == b"\xaa" * SIZE for b in bufs[4:])  # never read


def test_a_record_collected_after_it_was_planned_is_a_miss(
        disk: Path, pool: ThreadPoolExecutor) -> None:
    clock = FakeClock(now=1_000_000.0)
    shared, own = keys(2), keys(3)
    with PageStore(disk / "s", 0, lease_seconds=0, clock=clock) as store:
        old = secrets.token_hex(16)
        store.commit(make_root(old, shared + own, SIZE))
        store.commit(make_root(secrets.token_hex(16), shared + keys(1), SIZE))
        with direct_reader(disk / "s", pool) as reader:
            plan = reader.plan(shared + own)
            store.remove_roots([old])
            assert store.collect(100).objects == 3
            clock.now += PUNCH_DELAY_S
            store.collect(100)  # own's records punched: they read as zeros
            evict_from_page_cache(disk / "s")
            result = reader.read_planned(plan, [bytearray(SIZE) for _ in plan])
            assert (result.pages, result.bad, result.direct_bytes) == (2, (), 2 * SIZE)


def test_records_larger_than_a_request_are_read_one_a_request(
        disk: Path, pool: ThreadPoolExecutor) -> None:
    size = REQUEST_BYTES + 3 * 4096 + 7
    page_keys = keys(3)
    with PageStore(disk / "s", 0) as store:
        store.commit(make_root(secrets.token_hex(16), page_keys, size))
    evict_from_page_cache(disk / "s")
    with direct_reader(disk / "s", pool) as reader:
        bufs = [bytearray(size) for _ in page_keys]
        result = reader.restore(page_keys, bufs)
        assert (result.pages, result.direct_bytes) == (3, 3 * size)
        assert [bytes(b) for b in bufs] == [page_bytes(k, size) for k in page_keys]


class RefusesDirect(FileOps):
    """A filesystem that takes no O_DIRECT (tmpfs before Linux 6.6): EINVAL at the switch."""

    def __init__(self) -> None:
        self.asked = 0

    def set_direct(self, fd: int) -> None:
        self.asked += 1
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))


class RefusesDirectReads(FileOps):
    """A device that takes no direct read at a record's alignment (logical blocks larger
    than 4 KiB): the switch succeeds, every direct read answers EINVAL."""

    def readinto(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return super().readinto(fd, bufs, offset)


def test_a_filesystem_without_o_direct_is_read_through_the_page_cache(
        disk: Path, pool: ThreadPoolExecutor) -> None:
    page_keys = keys(8) + keys(5)
    with PageStore(disk / "s", 0) as store:
        store.commit(make_root(secrets.token_hex(16), page_keys[:8], SIZE))
        store.commit(make_root(secrets.token_hex(16), page_keys, SIZE))  # a second pack
    ops = RefusesDirect()
    with direct_reader(disk / "s", pool, ops) as reader:
        for _ in range(2):  # the first run finds out, no later one asks again
            evict_from_page_cache(disk / "s")
            bufs = [bytearray(SIZE) for _ in page_keys]
            result = reader.restore(page_keys, bufs)
            assert (result.pages, result.direct_bytes, result.buffered_bytes) == (
                13, 0, 13 * SIZE)
            assert [bytes(b) for b in bufs] == [page_bytes(k, SIZE) for k in page_keys]
        assert ops.asked == 1


def test_a_device_that_refuses_the_reads_is_read_through_the_page_cache(
        disk: Path, pool: ThreadPoolExecutor) -> None:
    page_keys = keys(8)
    with PageStore(disk / "s", 0) as store:
        store.commit(make_root(secrets.token_hex(16), page_keys, SIZE))
    evict_from_page_cache(disk / "s")
    with direct_reader(disk / "s", pool, RefusesDirectReads()) as reader:
        bufs = [bytearray(SIZE) for _ in page_keys]
        result = reader.restore(page_keys, bufs)
        assert (result.pages, result.bad, result.direct_bytes, result.buffered_bytes) == (
            8, (), 0, 8 * SIZE)
        assert [bytes(b) for b in bufs] == [page_bytes(k, SIZE) for k in page_keys]
