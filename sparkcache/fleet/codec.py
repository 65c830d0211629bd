"""A page as the cluster stores it: a header naming the page, then its bytes.

    magic "SCP1" (layout 1) | page key, 16 raw bytes | payload length, u64 LE |
    CRC-32C of the payload, u32 LE | payload

A value fetched under a page's name is served only if its header names that page, its
length is the length of what follows and its checksum holds, as a local read verifies a
record (``store/objects.py``): a value planted or damaged under a right name, or a
write cut short by a failover, is a miss, never a page. The page key is itself chained
over the whole prefix and the namespace (``identity``), so pages of different models,
layouts or tenants never share a name.
"""

from __future__ import annotations

import struct

import crc32c

from sparkcache.identity import KEY_BYTES
from sparkcache.store.records import Buffer

MAGIC = b"SCP1"
HEADER = struct.Struct(f"<4s{KEY_BYTES}sQI")


class BadSharedPage(ValueError):
    """A value under a page's name that is not that page; the message says how."""


def encode(key: bytes, payload: Buffer) -> bytes:
    """The value stored under page ``key`` (raw, ``KEY_BYTES``) for ``payload``."""
    data = memoryview(payload).cast("B")
    return HEADER.pack(MAGIC, key, data.nbytes, crc32c.crc32c(data)) + data


def decode(key: bytes, value: bytes) -> memoryview:
    """The payload of ``value`` if it is page ``key``'s; ``BadSharedPage`` otherwise."""
    if len(value) < HEADER.size:
        raise BadSharedPage(f"{len(value)} bytes: shorter than a header")
    magic, named, length, crc = HEADER.unpack_from(value)
    if magic != MAGIC:
        raise BadSharedPage(f"magic {magic!r}, not {MAGIC!r}")
    if named != key:
        raise BadSharedPage(f"the header names page {named.hex()}")
    payload = memoryview(value)[HEADER.size:]
    if payload.nbytes != length:
        raise BadSharedPage(f"{payload.nbytes} bytes of payload, the header says {length}")
    if crc32c.crc32c(payload) != crc:
        raise BadSharedPage("checksum mismatch")
    return payload
