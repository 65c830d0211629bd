"""Seqlocked stats blocks: one record per worker, written by that worker alone and read
by any process (the supervisor, the engine-side client) without locks.

Payload layout, STATS_LAYOUT_VERSION 1: META (slots u64, record bytes u64) on a
128-byte line, then ``slots`` entries, each on its own 128-byte-aligned span:

    seq u64 | crc u32 | pad u32 | record (the caller's dtype: pid, state, heartbeat ...)

Writer: seq += 1 (odd: writing), write record, crc = crc32(record), seq += 1 (even).
Reader: copy seq, record, crc, seq; accept when both seqs are equal and even and the crc
matches, else retry. Python cannot fence, so on arm64 the record's stores may become
visible out of order with seq's: the crc is what rejects such a torn copy.
"""

from __future__ import annotations

import struct
import time
import zlib

from sparkcache.shm.records import RecordLayout
from sparkcache.shm.segment import PAYLOAD_OFFSET, Segment, SegmentSpec

STATS_LAYOUT_VERSION = 1
STATS_KIND = "stats"
_META = struct.Struct("<QQ")
_HEAD = struct.Struct("<QI4x")
_ENTRIES_AT = 128
_ALIGN = 128


class TornRead(RuntimeError):
    """No consistent copy within the retry budget (the writer kept writing)."""


def _entry_bytes(layout: RecordLayout) -> int:
    return (_HEAD.size + layout.itemsize + _ALIGN - 1) // _ALIGN * _ALIGN


def _spec(layout: RecordLayout) -> SegmentSpec:
    return SegmentSpec(STATS_KIND, STATS_LAYOUT_VERSION * 1000 + layout.version, layout.fingerprint)


class StatsBlock:
    def __init__(self, seg: Segment, layout: RecordLayout) -> None:
        self._seg = seg
        self._mm = seg.mm
        self.layout = layout
        self.name = seg.name
        self.slots, _ = _META.unpack_from(seg.mm, PAYLOAD_OFFSET)
        self._stride = _entry_bytes(layout)
        self._seqs: dict[int, int] = {}

    @classmethod
    def create(cls, name: str, layout: RecordLayout, slots: int) -> StatsBlock:
        if slots < 1:
            raise ValueError(f"stats block of {slots} slots: expected at least 1")
        seg = Segment.create(name, _spec(layout), _ENTRIES_AT + slots * _entry_bytes(layout),
                             reserve=True)
        _META.pack_into(seg.mm, PAYLOAD_OFFSET, slots, layout.itemsize)
        return cls(seg, layout)

    @classmethod
    def attach(cls, name: str, layout: RecordLayout) -> StatsBlock:
        return cls(Segment.attach(name, _spec(layout)), layout)

    def _at(self, slot: int) -> int:
        if not 0 <= slot < self.slots:
            raise IndexError(f"stats slot {slot}: expected 0-{self.slots - 1}")
        return PAYLOAD_OFFSET + _ENTRIES_AT + slot * self._stride

    def write(self, slot: int, record: tuple) -> None:
        """Publish ``record`` (a tuple in field order) in ``slot``; one writer per slot."""
        at = self._at(slot)
        seq = self._seqs.get(slot)
        if seq is None:
            seq = _HEAD.unpack_from(self._mm, at)[0] & ~1
        raw = self.layout.packer.pack(*record)
        _HEAD.pack_into(self._mm, at, seq + 1, 0)
        self._mm[at + _HEAD.size : at + _HEAD.size + len(raw)] = raw
        _HEAD.pack_into(self._mm, at, seq + 2, zlib.crc32(raw))
        self._seqs[slot] = seq + 2

    def read(self, slot: int, retries: int = 1000) -> tuple | None:
        """A consistent copy of ``slot``'s record, or None if it was never written."""
        at = self._at(slot)
        end = at + _HEAD.size + self.layout.itemsize
        for attempt in range(retries):
            seq1, crc = _HEAD.unpack_from(self._mm, at)
            raw = self._mm[at + _HEAD.size : end]
            seq2, crc2 = _HEAD.unpack_from(self._mm, at)
            if seq1 == 0:
                return None
            if seq1 == seq2 and not seq1 & 1 and crc == crc2 == zlib.crc32(raw):
                return self.layout.named(*self.layout.packer.unpack(raw))
            if attempt > 16:
                time.sleep(0)  # let a descheduled writer finish
        raise TornRead(f"stats slot {slot} of {self.name}: no consistent read in {retries} tries")

    def close(self) -> None:
        self._seg.close()

    def __enter__(self) -> StatsBlock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
