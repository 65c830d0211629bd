"""The shared-memory segments of one rank: names, layouts, sizes. The supervisor creates
and unlinks them; the client and the workers attach by these names."""

from __future__ import annotations

import errno
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from sparkcache.config import AccessMode, Config
from sparkcache.shm import (
    Consumer,
    Producer,
    Ring,
    Segment,
    SegmentError,
    SlotArena,
    StatsBlock,
    segment_name,
)
from sparkcache.shm.layouts import (
    COMPLETION,
    DURABLE,
    ENGINE_STATS,
    FILLED,
    FREED,
    LOAD,
    LOADED,
    PUBLISH,
    REQUEST,
    WORKER_STATS,
)
from sparkcache.shm.note import NOTE_MAX_BYTES, create_note, read_note
from sparkcache.shm.records import RecordLayout
from sparkcache.shm.segment import user_prefix

log = logging.getLogger(__name__)

# An engine's own segment (its KV, or a staging pool: sparkcache.kvmem.SharedKVCaches) is
# named <instance>.r<rank>.kv<pid>: it belongs to the engine, not to a supervisor, and
# outlives supervisor restarts. Here, not in kvmem, so that the supervisor (and every
# worker that spawn starts through the CLI) does not import torch to recognise one.
_ENGINE_ENTRY_RE = re.compile(r"\.r\d+\.kv\d+$")


def engine_segment_role(pid: int) -> str:
    """The role part of the name of engine process ``pid``'s own segment."""
    return f"kv{pid}"


def is_engine_segment(entry: str) -> bool:
    """Is ``/dev/shm`` entry ``entry`` an engine's own segment?"""
    return _ENGINE_ENTRY_RE.search(entry) is not None

# Ring capacities, in records. PUBLISH and LOAD hold one record per page: a publication or
# a load is pushed as one batch, so this also caps the pages of one (300k tokens of
# 16-token pages fit in both).
RINGS: dict[str, tuple[RecordLayout, int]] = {
    "publish": (PUBLISH, 32768),
    "completion": (COMPLETION, 1024),
    "filled": (FILLED, 256),
    "freed": (FREED, 256),
    "durable": (DURABLE, 1024),
    "request": (REQUEST, 4096),
    # The same requests (leases only) from the vLLM scheduler's process: a ring has one
    # producer, and the scheduler is not the engine worker that owns "request".
    "lease": (REQUEST, 4096),
    "load": (LOAD, 32768),
    "loaded": (LOADED, 1024),
}
# The most pages of publications lent ahead of one that its deadline allows for
# (``protocol.release_seconds``): what the ring holds and capture has taken from it.
PUBLISH_AHEAD_MAX_PAGES = 2 * RINGS["publish"][1]
ARENA = "arena"
STATS = "stats"
STATS_SLOTS = 5  # one per worker role (workers.lifecycle.Role: its value is its slot)
# The engine's counters (ENGINE_STATS), one slot per engine-side writer
# (sparkcache.engine_stats): the supervisor creates the block so that it can serve them.
ENGINE = "engine_stats"
ENGINE_SLOTS = 2
# The rank's note (``shm.note``): which store its supervisor serves. An engine whose
# connector names another store dir than the supervisor of its instance would otherwise
# publish to workers that never see its registration (docs/vllm.md, "Attached").
NOTE = "note"
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


def attach_engine_stats(cfg: Config, rank: int) -> StatsBlock:
    return StatsBlock.attach(name(cfg.instance, rank, ENGINE), ENGINE_STATS)


def store_note(cfg: Config, rank: int) -> dict:
    """What rank ``rank``'s note says (the rank is in its name): the store dir (resolved)
    its supervisor serves, that supervisor's pid and the instance."""
    return {"store_dir": str(Path(cfg.store_dir).resolve()), "instance": cfg.instance,
            "supervisor_pid": os.getpid()}


def running_stores() -> list[dict]:
    """The notes of this user's running supervisors (rank 0's of each instance): which
    instance serves which store, for a tool pointed at a store no supervisor serves."""
    found = []
    for path in sorted(SHM_DIR.glob(f"{user_prefix()}*.r0.{NOTE}")):
        try:
            note = read_note("/" + path.name)
        except SegmentError:
            continue
        if note is not None and isinstance(note.get("store_dir"), str):
            found.append(note)
    return found


def read_store_note(instance: str, rank: int) -> dict | None:
    """Rank ``rank``'s note of ``instance``'s running supervisor, or None (no supervisor,
    or one of a version without notes)."""
    return read_note(name(instance, rank, NOTE))


@dataclass
class RankSegments:
    """Every segment of one rank, as created by the supervisor (their owner)."""

    rank: int
    rings: dict[str, Ring]
    arena: SlotArena
    stats: StatsBlock
    # None where an observer found none (a supervisor of an older version).
    engine: StatsBlock | None = None
    note: Segment | None = None

    @classmethod
    def create(cls, cfg: Config, rank: int, stats_slots: int) -> RankSegments:
        """Every segment allocated as it is made (``Segment.create``'s ``reserve``): a
        /dev/shm that filled after ``check_shm_space`` fails here, with ShmSpaceError,
        instead of with a SIGBUS at the first touch of a page, in a worker or in vLLM.
        The arena is not allocated without capture (nothing writes it)."""
        made: list = []
        what = ""
        try:
            # First: whoever finds the rank's other segments finds it written.
            what = name(cfg.instance, rank, NOTE)
            note = create_note(what, store_note(cfg, rank))
            made.append(note)
            rings = {}
            for role, (layout, capacity) in RINGS.items():
                what = name(cfg.instance, rank, role)
                rings[role] = Ring.create(what, layout, capacity)
                made.append(rings[role])
            what = name(cfg.instance, rank, ARENA)
            arena = SlotArena.create(what, cfg.capture_slots, cfg.capture_slot_bytes,
                                     reserve=cfg.access_mode is AccessMode.READ_WRITE)
            made.append(arena)
            what = name(cfg.instance, rank, STATS)
            stats = StatsBlock.create(what, WORKER_STATS, stats_slots)
            made.append(stats)
            what = name(cfg.instance, rank, ENGINE)
            engine = StatsBlock.create(what, ENGINE_STATS, ENGINE_SLOTS)
        except BaseException as exc:
            for seg in made:
                seg.close()
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                free = os.statvfs(SHM_DIR)
                raise ShmSpaceError(
                    f"{SHM_DIR} filled up while rank {rank}'s segments were made ({what}: no "
                    f"space; {_size(free.f_bavail * free.f_frsize)} free now): free "
                    f"{SHM_DIR} or give it more room (docker run --shm-size)") from None
            raise
        return cls(rank, rings, arena, stats, engine, note)

    def close(self) -> None:
        """Unlink everything; the owner's job."""
        for ring in self.rings.values():
            ring.close()
        self.arena.close()
        self.stats.close()
        if self.engine is not None:
            self.engine.close()
        if self.note is not None:
            self.note.close()


# ---------------------------------------------------------------------- /dev/shm space

SHM_DIR = Path("/dev/shm")
_PAGE = 4096
_HEADER = 64 + 3 * 128  # segment header + a primitive's metadata lines (an upper bound)


def _pages(n: int) -> int:
    return (n + _PAGE - 1) // _PAGE * _PAGE


def shm_needed(cfg: Config) -> dict[str, int]:
    """Bytes of /dev/shm one rank's segments take once in use, to the page (an upper
    bound): the arena (only in read-write mode: without capture nobody touches it and
    tmpfs allocates nothing), the rings (records and their table, two semaphores each),
    the stats blocks (the workers' and the engine's), the note."""
    arena = 0
    if cfg.access_mode is AccessMode.READ_WRITE:
        # Slot data starts on a page past the header and slot table: one page more.
        table = _pages(_HEADER + 32 * cfg.capture_slots) + _PAGE
        arena = cfg.capture_slots * cfg.capture_slot_bytes + table
    rings = sum(
        _pages(_HEADER + capacity * (layout.itemsize + 32)) + 2 * _PAGE
        for layout, capacity in RINGS.values()
    )
    stats = _pages(_HEADER + STATS_SLOTS * (16 + WORKER_STATS.itemsize + 128))
    engine = _pages(_HEADER + ENGINE_SLOTS * (16 + ENGINE_STATS.itemsize + 128))
    note = _pages(_HEADER + NOTE_MAX_BYTES)
    return {"arena": arena, "rings": rings, "stats": stats, "engine_stats": engine,
            "note": note}


class ShmSpaceError(RuntimeError):
    """/dev/shm cannot hold the segments of every rank."""


def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{int(n)}B"


def check_shm_space(cfg: Config, shm_dir: Path = SHM_DIR) -> None:
    """Refuse (ShmSpaceError, one line naming what is needed and what to change) when
    ``shm_dir`` has less free space than the ranks' segments need. tmpfs allocates on
    first touch, so without this a small /dev/shm (64 MiB in a container by default) is
    found out by a SIGBUS in the middle of a copy."""
    st = os.statvfs(shm_dir)
    if st.f_blocks == 0:
        return  # a tmpfs mounted without a size limit reports no blocks at all
    free = st.f_bavail * st.f_frsize
    need = shm_needed(cfg)
    total = cfg.ranks * sum(need.values())
    if total <= free:
        return
    other = _size(need["rings"] + need["stats"] + need["engine_stats"])
    arena = (f"{cfg.capture_slots} slots x {_size(cfg.capture_slot_bytes)} + "
             if need["arena"] else "")
    raise ShmSpaceError(
        f"{shm_dir} has {_size(free)} free; rank segments need {_size(total)} "
        f"({cfg.ranks} rank{'s' if cfg.ranks > 1 else ''} x ({arena}{other} of rings and "
        "stats)); use fewer or smaller capture slots (SPARKCACHE_CAPTURE_SLOTS, "
        f"SPARKCACHE_CAPTURE_SLOT_BYTES) or a larger {shm_dir} (docker run --shm-size)"
    )
