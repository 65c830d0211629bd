"""Shared-memory primitives, knowing nothing of KV caches: named segments with checked
headers, SPSC rings of fixed-size records, slot arenas and seqlocked stats blocks."""

from sparkcache.shm.arena import FREE, SlotArena, SlotOwnershipError
from sparkcache.shm.records import RecordLayout
from sparkcache.shm.ring import (
    Consumer,
    Producer,
    Ring,
    RingClosed,
    RingCorrupt,
    RingEmpty,
    RingFull,
)
from sparkcache.shm.segment import (
    ForeignSegment,
    LayoutMismatch,
    Segment,
    SegmentError,
    open_semaphore,
    segment_name,
    sweep,
)
from sparkcache.shm.stats import StatsBlock, TornRead

__all__ = [
    "FREE",
    "Consumer",
    "ForeignSegment",
    "LayoutMismatch",
    "Producer",
    "RecordLayout",
    "Ring",
    "RingClosed",
    "RingCorrupt",
    "RingEmpty",
    "RingFull",
    "Segment",
    "SegmentError",
    "SlotArena",
    "SlotOwnershipError",
    "StatsBlock",
    "TornRead",
    "open_semaphore",
    "segment_name",
    "sweep",
]
