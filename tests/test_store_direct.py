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
from pathlib import Path

import pytest
from eviction_util import FakeClock

from sparkcache.filesystems import MEMORY_FILESYSTEMS, filesystem_of
from sparkcache.store import PageStore
from sparkcache.store import direct as direct_module
from sparkcache.store import reader as reader_module
from sparkcache.store.direct import REQUEST_BYTES, DirectReads, mostly_cached
from sparkcache.store.objects import HEADER_SIZE
from sparkcache.store.reader import StoreReader
from sparkcache.store.store import PUNCH_DELAY_S
from sparkcache.store.testing import make_root, object_file, page_bytes

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


def evict(store_dir: Path) -> None:
    os.sync()
    for path in packs(store_dir):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        return mostly_cached(fd, 0, path.stat().st_size)
    finally:
        os.close(fd)


def direct_reader(store_dir: Path, pool: ThreadPoolExecutor) -> StoreReader:
    return StoreReader(store_dir, 0, direct=DirectReads(pool))


def test_a_cold_pack_is_read_past_the_page_cache_byte_exact(
        disk: Path, pool: ThreadPoolExecutor) -> None:
    first, second = keys(40), keys(24)
    with PageStore(disk / "s", 0) as store:
        store.commit(make_root(secrets.token_hex(16), first, SIZE))
        store.commit(make_root(secrets.token_hex(16), first + second, SIZE))  # its own pack
    evict(disk / "s")
    reader = direct_reader(disk / "s", pool)
    try:
        bufs = [bytearray(SIZE) for _ in first + second]
        result = reader.restore(first + second, bufs)
        assert (result.pages, result.bad) == (64, ())
        assert [bytes(b) for b in bufs] == [page_bytes(k, SIZE) for k in first + second]
        assert (reader.direct_runs, reader.cached_runs) == (2, 0)
        # Nothing was read into the page cache on the way.
        assert not any(cached(p) for p in packs(disk / "s"))
        # Into pieces, as a page goes into its KV blocks' runs.
        out = [bytearray(SIZE) for _ in first]
        pieces = [[memoryview(b)[:100], memoryview(b)[100:5000], memoryview(b)[5000:]]
                  for b in out]
        assert reader.read_planned(reader.plan(first), pieces).pages == 40
        assert [bytes(b) for b in out] == [page_bytes(k, SIZE) for k in first]
    finally:
        reader.close()


def test_a_cached_run_is_read_through_the_page_cache(
        disk: Path, pool: ThreadPoolExecutor) -> None:
    page_keys = keys(16)
    with PageStore(disk / "s", 0) as store:
        store.commit(make_root(secrets.token_hex(16), page_keys, SIZE))
    reader = direct_reader(disk / "s", pool)  # just committed: in the page cache
    try:
        bufs = [bytearray(SIZE) for _ in page_keys]
        assert reader.restore(page_keys, bufs).pages == 16
        assert [bytes(b) for b in bufs] == [page_bytes(k, SIZE) for k in page_keys]
        assert (reader.direct_runs, reader.cached_runs) == (0, 1)
    finally:
        reader.close()


def test_a_damaged_record_stops_the_run_and_nothing_of_it_is_copied(
        disk: Path, pool: ThreadPoolExecutor) -> None:
    page_keys = keys(6)
    with PageStore(disk / "s", 0) as store:
        store.commit(make_root(secrets.token_hex(16), page_keys, SIZE))
        pack, offset = object_file(store.layout.objects_dir, store._rconn, page_keys[3])
    data = bytearray(pack.read_bytes())
    data[offset + HEADER_SIZE + 11] ^= 0x10
    pack.write_bytes(data)
    evict(disk / "s")
    reader = direct_reader(disk / "s", pool)
    try:
        bufs = [bytearray(b"\xaa" * SIZE) for _ in page_keys]
        result = reader.restore(page_keys, bufs)
        assert result.pages == 3 and reader.direct_runs == 1
        assert [(b.key, b.reason) for b in result.bad] == [(page_keys[3], "checksum mismatch")]
        assert [bytes(b) for b in bufs[:3]] == [page_bytes(k, SIZE) for k in page_keys[:3]]
        assert bytes(bufs[3]) == bytes(SIZE)  # zeroed, as a buffered read leaves it
        assert all(bytes(b) == b"\xaa" * SIZE for b in bufs[4:])  # never read
    finally:
        reader.close()


def test_a_record_collected_after_it_was_planned_is_a_miss(
        disk: Path, pool: ThreadPoolExecutor) -> None:
    clock = FakeClock(now=1_000_000.0)
    shared, own = keys(2), keys(3)
    with PageStore(disk / "s", 0, lease_seconds=0, clock=clock) as store:
        old = secrets.token_hex(16)
        store.commit(make_root(old, shared + own, SIZE))
        store.commit(make_root(secrets.token_hex(16), shared + keys(1), SIZE))
        reader = direct_reader(disk / "s", pool)
        try:
            plan = reader.plan(shared + own)
            store.remove_roots([old])
            assert store.collect(100).objects == 3
            clock.now += PUNCH_DELAY_S
            store.collect(100)  # own's records punched: they read as zeros
            evict(disk / "s")
            result = reader.read_planned(plan, [bytearray(SIZE) for _ in plan])
            assert (result.pages, result.bad) == (2, ()) and reader.direct_runs == 1
        finally:
            reader.close()


def test_records_larger_than_a_request_are_read_one_a_request(
        disk: Path, pool: ThreadPoolExecutor) -> None:
    size = REQUEST_BYTES + 3 * 4096 + 7
    page_keys = keys(3)
    with PageStore(disk / "s", 0) as store:
        store.commit(make_root(secrets.token_hex(16), page_keys, size))
    evict(disk / "s")
    reader = direct_reader(disk / "s", pool)
    try:
        bufs = [bytearray(size) for _ in page_keys]
        assert reader.restore(page_keys, bufs).pages == 3 and reader.direct_runs == 1
        assert [bytes(b) for b in bufs] == [page_bytes(k, size) for k in page_keys]
    finally:
        reader.close()


def test_a_filesystem_without_o_direct_is_read_through_the_page_cache(
        tmp_path: Path, pool: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    """As one that refuses O_DIRECT answers (EINVAL; tmpfs did before Linux 6.6)."""
    page_keys = keys(8) + keys(5)
    with PageStore(tmp_path / "s", 0) as store:
        store.commit(make_root(secrets.token_hex(16), page_keys[:8], SIZE))
        store.commit(make_root(secrets.token_hex(16), page_keys, SIZE))  # a second pack
    asked = []
    real = fcntl.fcntl

    def refusing(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            asked.append(fd)
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, cmd, arg)

    monkeypatch.setattr(reader_module.fcntl, "fcntl", refusing)
    monkeypatch.setattr(reader_module, "mostly_cached", lambda *_: False)  # taken for cold
    reader = direct_reader(tmp_path / "s", pool)
    try:
        for _ in range(2):  # the first run finds out, the second does not ask again
            bufs = [bytearray(SIZE) for _ in page_keys]
            assert reader.restore(page_keys, bufs).pages == 13
            assert [bytes(b) for b in bufs] == [page_bytes(k, SIZE) for k in page_keys]
        assert reader.direct_runs == 0 and len(asked) == 1
    finally:
        reader.close()


def test_a_device_that_refuses_the_reads_is_read_through_the_page_cache(
        disk: Path, pool: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    """As one whose logical blocks are larger than 4 KiB answers each direct read."""
    page_keys = keys(8)
    with PageStore(disk / "s", 0) as store:
        store.commit(make_root(secrets.token_hex(16), page_keys, SIZE))
    evict(disk / "s")

    def refusing(fd: int, bufs: list, offset: int) -> int:
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    monkeypatch.setattr(direct_module, "_read", refusing)
    reader = direct_reader(disk / "s", pool)
    try:
        bufs = [bytearray(SIZE) for _ in page_keys]
        result = reader.restore(page_keys, bufs)
        assert (result.pages, result.bad, reader.direct_runs) == (8, (), 0)
        assert [bytes(b) for b in bufs] == [page_bytes(k, SIZE) for k in page_keys]
    finally:
        reader.close()
