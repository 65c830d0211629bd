"""A page as the cluster stores it: a header naming the page, then its bytes.

    magic "SCP2" (layout 2) | rank, u16 LE | page key, 16 raw bytes |
    payload length, u64 LE | CRC-32C of the payload, u32 LE | payload

(Layout 1 had no rank: a rank's pages of a tensor-parallel model are its own heads, and
its keys are every rank's keys, so the rank is in the name and in the header.)

A value fetched under a page's name is served only if its header names that page of that
rank, its length is the length of what follows and its checksum holds, as a local read
verifies a record (``store/objects.py``): a value planted or damaged under a right name,
or a write cut short by a failover, is a miss, never a page. The page key is itself
chained over the whole prefix and the namespace (``identity``), so pages of different
models, layouts or tenants never share a name.
"""

from __future__ import annotations

import struct

import crc32c

from sparkcache.identity import KEY_BYTES
from sparkcache.store.records import Buffer

MAGIC = b"SCP2"
HEADER = struct.Struct(f"<4sH{KEY_BYTES}sQI")


class BadSharedPage(ValueError):
    """A value under a page's name that is not that page; the message says how."""


def encode(rank: int, key: bytes, payload: Buffer) -> bytes:
    """The value stored under rank ``rank``'s page ``key`` (raw, ``KEY_BYTES``)."""
    data = memoryview(payload).cast("B")
    return HEADER.pack(MAGIC, rank, key, data.nbytes, crc32c.crc32c(data)) + data


def frame(rank: int, key: bytes, buf: Buffer) -> memoryview:
    """``encode`` in place: ``buf`` holds ``HEADER.size`` bytes of room, then the payload
    (read there by the caller); the header is written into the room. The whole of
    ``buf``, a value to store, without a copy of the payload."""
    view = memoryview(buf).cast("B")
    payload = view[HEADER.size:]
    HEADER.pack_into(view, 0, MAGIC, rank, key, payload.nbytes, crc32c.crc32c(payload))
    return view


def decode(rank: int, key: bytes, value: bytes) -> memoryview:
    """The payload of ``value`` if it is rank ``rank``'s page ``key``; ``BadSharedPage``
    otherwise."""
    if len(value) < HEADER.size:
        raise BadSharedPage(f"{len(value)} bytes: shorter than a header")
    magic, named_rank, named, length, crc = HEADER.unpack_from(value)
    if magic != MAGIC:
        raise BadSharedPage(f"magic {magic!r}, not {MAGIC!r}")
    if named_rank != rank:
        raise BadSharedPage(f"the header names rank {named_rank}, not {rank}")
    if named != key:
        raise BadSharedPage(f"the header names page {named.hex()}")
    payload = memoryview(value)[HEADER.size:]
    if payload.nbytes != length:
        raise BadSharedPage(f"{payload.nbytes} bytes of payload, the header says {length}")
    if crc32c.crc32c(payload) != crc:
        raise BadSharedPage("checksum mismatch")
    return payload
