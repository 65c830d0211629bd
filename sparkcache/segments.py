"""The shared-memory segments of one rank: names, layouts, sizes. The supervisor creates
and unlinks them; the client and the workers attach by these names."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from shm import Consumer, Producer, Ring, SlotArena, StatsBlock, segment_name
from shm.layouts import COMPLETION, DURABLE, FILLED, FREED, PUBLISH, REQUEST, WORKER_STATS
from shm.records import RecordLayout
from sparkcache.config import Config

log = logging.getLogger(__name__)

# Ring capacities, in records. PUBLISH holds one record per page: a publication is pushed
# as one batch, so this also caps the pages of one publication.
RINGS: dict[str, tuple[RecordLayout, int]] = {
    "publish": (PUBLISH, 16384),
    "completion": (COMPLETION, 1024),
    "filled": (FILLED, 256),
    "freed": (FREED, 256),
    "durable": (DURABLE, 1024),
    "request": (REQUEST, 4096),
}
ARENA = "arena"
STATS = "stats"
# Slot owners in the arena (FREE = 0 is shm.FREE).
OWNER_CAPTURE = 1
OWNER_COMMIT = 2


def name(cfg_instance: str, rank: int, role: str) -> str:
    return segment_name(cfg_instance, rank, role)


def producer(cfg: Config, rank: int, role: str) -> Producer:
    """The writing end of ring ``role`` of ``rank``, with its layout from RINGS."""
    return Producer(name(cfg.instance, rank, role), RINGS[role][0])


def consumer(cfg: Config, rank: int, role: str, **options: float) -> Consumer:
    """The reading end of ring ``role`` of ``rank``, with its layout from RINGS."""
    return Consumer(name(cfg.instance, rank, role), RINGS[role][0], **options)


def attach_arena(cfg: Config, rank: int) -> SlotArena:
    return SlotArena.attach(name(cfg.instance, rank, ARENA))


def attach_stats(cfg: Config, rank: int) -> StatsBlock:
    return StatsBlock.attach(name(cfg.instance, rank, STATS), WORKER_STATS)


@dataclass
class RankSegments:
    """Every segment of one rank, as created by the supervisor (their owner)."""

    rank: int
    rings: dict[str, Ring]
    arena: SlotArena
    stats: StatsBlock

    @classmethod
    def create(cls, cfg: Config, rank: int, stats_slots: int) -> RankSegments:
        made: list = []
        try:
            rings = {}
            for role, (layout, capacity) in RINGS.items():
                rings[role] = Ring.create(name(cfg.instance, rank, role), layout, capacity)
                made.append(rings[role])
            arena = SlotArena.create(
                name(cfg.instance, rank, ARENA), cfg.capture_slots, cfg.capture_slot_bytes
            )
            made.append(arena)
            stats = StatsBlock.create(name(cfg.instance, rank, STATS), WORKER_STATS, stats_slots)
        except BaseException:
            for seg in made:
                seg.close()
            raise
        return cls(rank, rings, arena, stats)

    def close(self) -> None:
        """Unlink everything; the owner's job."""
        for ring in self.rings.values():
            ring.close()
        self.arena.close()
        self.stats.close()
