"""The object format, and writing and verified reading of object files and packs.

An object (a record) is a 64-byte header followed by the page bytes; an object file holds
one, a pack the new pages of one publication back to back, each a record of its own with
the pack's generation (docs/store.md, "Packs")::

    offset size field
         0    8 magic b"SPKCPAGE"
         8    2 format version (1)
        10    2 header length (64)
        12    4 flags (FLAG_CRC32C, or 0)
        16   16 page key (raw digest)
        32    8 generation (raw)
        40    8 payload length
        48   12 reserved (zero)
        60    4 checksum of bytes 0..59 followed by the payload

All integers little-endian. The checksum is CRC-32C (Castagnoli) when flags has
FLAG_CRC32C, what is written now; objects with flags 0, written before, carry zlib's
CRC-32 and are still read. CRC-32C runs at ~19 GB/s here with the CPU's CRC instructions
(the crc32c package; ARMv8 has them too) against ~1.8 GB/s for zlib's CRC-32, which had
been 0.26 of the restore worker's 0.46 ms of CPU per 512 KiB page (docs/pipeline.md).
Either detects every error of up to 3 bits and every burst of up to 32 bits, so a
flipped bit anywhere in the file is always caught; they guard against media and
torn-write damage, not against an adversary who can write the store (who could rewrite
the index as well). The key, generation and length are checked on their own too.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import crc32c

from sparkcache.store.fileops import FileOps, StepHook
from sparkcache.store.layout import FILE_MODE, object_name, temp_name

MAGIC = b"SPKCPAGE"
OBJECT_FORMAT_VERSION = 1
FLAG_CRC32C = 1
_HEADER = struct.Struct("<8sHHI16s8sQ12sI")
HEADER_SIZE = _HEADER.size
_CHECKED = HEADER_SIZE - 4
_RESERVED = bytes(12)
_ZEROS = bytes(4096)  # padding, never more than a block
IOV_MAX = os.sysconf("SC_IOV_MAX")
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC

assert HEADER_SIZE == 64

# A file is written this many bytes at a time, each chunk's writeback started once it is
# written: one writev and one sync_file_range per chunk, where two writes and a writeback
# per record cost more than the bytes of a 64 KiB page (~110 of its ~390 us, measured).
WRITE_CHUNK_BYTES = 4 << 20

# A record of a pack starts on a block boundary and its span is padded with zeros to the
# next one: collecting it frees (punches) whole blocks and nothing of its neighbours.
RECORD_ALIGN = 4096


def record_span(payload_bytes: int) -> int:
    """Bytes a record of ``payload_bytes`` occupies in a pack, padding included."""
    return -(-(HEADER_SIZE + payload_bytes) // RECORD_ALIGN) * RECORD_ALIGN


class ObjectCorrupt(Exception):
    """An object file failed verification; the message says which check."""


def split_pieces(
    pieces: list[memoryview], at: int
) -> tuple[list[memoryview], list[memoryview]]:
    """The first ``at`` bytes of the concatenation of ``pieces``, and the rest."""
    head: list[memoryview] = []
    for i, p in enumerate(pieces):
        if at < p.nbytes:
            return head + ([p[:at]] if at else []), [p[at:], *pieces[i + 1 :]]
        head.append(p)
        at -= p.nbytes
    return head, []


# What is written: CRC-32C. Read: either (see the module's docstring).
WRITE_FLAGS = FLAG_CRC32C
_CHECKSUMS = {FLAG_CRC32C: crc32c.crc32c, 0: zlib.crc32}


def build_header(key: str, generation: str, payload: list[memoryview]) -> bytes:
    flags = WRITE_FLAGS
    head = _HEADER.pack(
        MAGIC,
        OBJECT_FORMAT_VERSION,
        HEADER_SIZE,
        flags,
        bytes.fromhex(key),
        bytes.fromhex(generation),
        sum(p.nbytes for p in payload),
        _RESERVED,
        0,
    )[:_CHECKED]
    checksum = _CHECKSUMS[flags]
    crc = checksum(head)
    for p in payload:
        crc = checksum(p, crc)
    return head + struct.pack("<I", crc)


def _write_all(ops: FileOps, fd: int, pieces: list[memoryview]) -> None:
    # writev takes at most IOV_MAX pieces and may write fewer bytes than asked.
    while pieces:
        n = ops.write(fd, pieces[:IOV_MAX])
        if n <= 0:  # a regular file that accepts nothing is full; never spin
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        pieces = split_pieces(pieces, n)[1]


@dataclass(frozen=True)
class Record:
    """One object to write into a file: its header, once ``build_header`` has it (a
    thunk, so the writer waits for each checksum only when it reaches that record), its
    payload in pieces, and the zeros that pad it to its span in a pack."""

    header: Callable[[], bytes]
    payload: list[memoryview]
    padding: int = 0

    @cached_property
    def size(self) -> int:
        return HEADER_SIZE + sum(p.nbytes for p in self.payload) + self.padding


def write_temp(
    ops: FileOps, dir_fd: int, key: str, generation: str, records: list[Record],
    hook: StepHook, recycled_fd: int | None = None,
) -> int:
    """Write ``<key>.<generation>.tmp`` under ``dir_fd``: ``records`` one after another
    (one record: an object file; more: a pack, ``key`` being its first record's),
    ``WRITE_CHUNK_BYTES`` at a time, each chunk's writeback started as soon as it is
    written, so the disk writes one while the next is written. Returns the open
    descriptor.

    ``recycled_fd``: the temp is a pooled file already renamed to that name
    (``FilePool.take``), overwritten in place from its start, then cut to its size if it
    was longer or extended if shorter. The file is not yet durable: the caller closes it,
    and makes all of a commit's files durable together once every one is written
    (``writer``). On failure the descriptor is closed and the file removed.
    """
    name = temp_name(key, generation)
    fd = ops.open(name, _WRITE_FLAGS, FILE_MODE, dir_fd) if recycled_fd is None else recycled_fd
    try:
        if recycled_fd is not None:
            hook("commit.recycled")
        at, chunk, chunk_bytes = 0, [], 0
        for i, record in enumerate(records):
            chunk += [memoryview(record.header()), *record.payload]
            if record.padding:
                chunk.append(memoryview(_ZEROS)[:record.padding])
            chunk_bytes += record.size
            if chunk_bytes >= WRITE_CHUNK_BYTES or i == len(records) - 1:
                # In two writes, with a step between: a kill there leaves a torn file.
                first, rest = split_pieces(chunk, chunk_bytes // 2)
                _write_all(ops, fd, first)
                hook("commit.temp_write")
                _write_all(ops, fd, rest)
                ops.start_writeback(fd, at, chunk_bytes)
                hook("commit.written")
                at, chunk, chunk_bytes = at + chunk_bytes, [], 0
        if recycled_fd is not None and os.fstat(fd).st_size != at:
            ops.truncate(fd, at)
    except BaseException:
        ops.close(fd)
        try:
            ops.unlink(name, dir_fd)
        except FileNotFoundError:
            pass
        raise
    return fd


# What opening an object's name can meet that the store never puts there.
_NOT_OURS = frozenset({errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.ENODEV, errno.EACCES,
                       errno.EPERM})


def open_object(ops: FileOps, dir_fd: int, key: str, generation: str) -> int:
    """Open object ``key.generation`` for reading, never through a symlink.

    Raises FileNotFoundError if it is absent, ObjectCorrupt if what is there is not a file
    the store made (a symlink planted in its place, never followed; a directory, a
    device, a file whose mode was changed), and any other OSError as it is: ``EMFILE``
    or ``EIO`` say nothing about the object, and quarantining on them condemned good ones.
    """
    try:
        return ops.open(object_name(key, generation), _READ_FLAGS, 0, dir_fd)
    except OSError as exc:
        if exc.errno in _NOT_OURS:
            raise ObjectCorrupt(f"cannot open object: {exc.strerror}") from exc
        raise


def read_verified(
    ops: FileOps, fd: int, key: str, generation: str, length: int,
    out: memoryview | list[memoryview], offset: int | None = None,
) -> None:
    """Read the object in the open file ``fd`` into ``out[:length]`` and verify it
    completely: the whole file (``offset`` None), or the record at ``offset`` of a pack.

    ``out`` may instead be the pieces the payload is scattered into, in order: writable
    byte views, exactly ``length`` bytes together and fewer than ``IOV_MAX`` (a page
    straight into the KV blocks' runs, ``kvmem.BlockViews.page_runs``; the caller checks,
    ``StoreReader.read_planned``).
    Raises ObjectCorrupt if any check fails; then the payload's bytes in ``out`` are
    zeroed so no unverified byte is left in the caller's buffers.
    """
    body = out if isinstance(out, list) else [out[:length]]
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ObjectCorrupt("not a regular file")
    if offset is None and st.st_size != HEADER_SIZE + length:
        raise ObjectCorrupt(f"size {st.st_size} != {HEADER_SIZE + length}")
    if offset is not None and st.st_size < offset + HEADER_SIZE + length:
        raise ObjectCorrupt(f"pack of {st.st_size} bytes ends inside the record at {offset}")
    header = bytearray(HEADER_SIZE)
    start = offset or 0
    try:
        # Two reads: one preadv of the header and the payload together read a cold record
        # ~25 % slower (64 records of 512 KiB: 11.5 against 8.8 ms; docs/store.md, "Reading
        # a pack"), and the second read is sequential to the first for the kernel.
        if (ops.readinto(fd, [memoryview(header)], start) != HEADER_SIZE
                or ops.readinto(fd, body, start + HEADER_SIZE) != length):
            raise ObjectCorrupt("short read")
        check_header(header, key, generation, length, body)
    except BaseException:
        zero(body)
        raise


def zero(pieces: list[memoryview]) -> None:
    """Leave no byte of a page that failed in the caller's buffers."""
    for piece in pieces:
        piece[:] = bytes(piece.nbytes)


def check_header(
    header: bytearray, key: str, generation: str, length: int, payload: list[memoryview]
) -> None:
    magic, version, hlen, flags, hkey, hgen, hlength, reserved, crc = _HEADER.unpack(header)
    if magic != MAGIC:
        raise ObjectCorrupt("bad magic")
    checksum = _CHECKSUMS.get(flags)
    if version != OBJECT_FORMAT_VERSION or hlen != HEADER_SIZE or checksum is None:
        raise ObjectCorrupt(f"unsupported format version {version} / header {hlen} / {flags}")
    if hkey != bytes.fromhex(key):
        raise ObjectCorrupt("key mismatch")
    if hgen != bytes.fromhex(generation):
        raise ObjectCorrupt("generation mismatch")
    if hlength != length:
        raise ObjectCorrupt(f"length {hlength} != {length}")
    if reserved != _RESERVED:
        raise ObjectCorrupt("reserved bytes not zero")
    value = checksum(memoryview(header)[:_CHECKED])
    for piece in payload:
        value = checksum(piece, value)
    if value != crc:
        raise ObjectCorrupt("checksum mismatch")


def verify_file(ops: FileOps, dir_fd: int, key: str, generation: str, length: int,
                file_key: str | None = None, offset: int = 0) -> None:
    """Verify an object without a caller buffer (fsck): its own file under ``dir_fd``, or
    (``file_key`` given) its record at ``offset`` of that pack."""
    fd = open_object(ops, dir_fd, file_key or key, generation)
    try:
        read_verified(ops, fd, key, generation, length, memoryview(bytearray(length)),
                      None if file_key is None else offset)
    finally:
        ops.close(fd)
