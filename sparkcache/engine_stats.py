"""The engine side's counters in shared memory, for the supervisor's ``/metrics``.

Counters of the engine's processes (publications skipped by reason, lookups and their hit
tokens, loads by result) live in those processes; the supervisor cannot read them. So
each engine-side writer copies its totals into its own slot of the rank's engine stats
block (``shm.layouts.ENGINE_STATS``, created by the supervisor with the rank's other
segments): slot 0 is the rank's ``SparkCacheClient``, slot 1 the prefix lookups of
vLLM's scheduler (one scheduler for every rank: rank 0's block only). One writer per
slot; a restarted engine process writes the same slot again, counting from 0.

A write packs one record and takes the seqlock (a few microseconds): callers ask from
calls they already make every engine step, and ``write_due`` writes at most once per
``WRITE_INTERVAL_S``; a step that is not due pays one clock read. Nothing here raises
into the serving path: a block that is missing (no supervisor, or an older one) or fails
means the counters are simply not published.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Mapping

from sparkcache import segments
from sparkcache.config import Config
from sparkcache.shm import StatsBlock
from sparkcache.shm.layouts import (
    ENGINE_STATS,
    LOOKUP_MISS_REASONS,
)
from sparkcache.shm.segment import process_start

log = logging.getLogger(__name__)

# The engine steps every few ms; this keeps publishing far below measurable, and the
# supervisor's report age says how old the figures are (scrapes come every 15 s or so).
WRITE_INTERVAL_S = 0.5
SLOT_CLIENT = 0
SLOT_LOOKUP = 1
# slot -> the ``writer`` label of its series.
WRITERS = {SLOT_CLIENT: "client", SLOT_LOOKUP: "lookup"}
assert len(WRITERS) == segments.ENGINE_SLOTS

Fields = Mapping[str, float]


@functools.cache
def _field_names(prefix: str, known: tuple[str, ...]) -> dict[str, str]:
    return {reason: prefix + reason for reason in known}


def by_reason(prefix: str, counts: Mapping[str, int], known: tuple[str, ...]) -> dict[str, int]:
    """``counts`` (reason -> n) as the fields ``<prefix><reason>`` of ``known``; a reason
    not known (one the code added later) is added to ``<prefix>other``."""
    names = _field_names(prefix, known)
    out = dict.fromkeys(names.values(), 0)
    other = prefix + "other"
    for reason, n in counts.items():
        out[names.get(reason, other)] += n
    return out


def lookup_fields(lookups: int, tokens: int, hit_tokens: int,
                  misses: Mapping[str, int]) -> dict[str, float]:
    """The fields of a lookup-only writer's record (``PrefixLookup``)."""
    return {
        "lookups": lookups,
        "lookup_tokens": tokens,
        "lookup_hit_tokens": hit_tokens,
        **by_reason("lookup_miss_", misses, LOOKUP_MISS_REASONS),
    }


class EngineStatsWriter:
    """Writes one slot of a rank's engine stats block, at most once per interval."""

    def __init__(self, block: StatsBlock, slot: int) -> None:
        self._block = block
        self.slot = slot
        self._names = ENGINE_STATS.dtype.names
        self._zeros = dict.fromkeys(self._names, 0)
        self._pid = os.getpid()
        self._pid_start = process_start(self._pid)
        self._due = 0.0

    @classmethod
    def attach(cls, cfg: Config, rank: int, slot: int) -> EngineStatsWriter | None:
        """A writer of ``slot`` of ``rank``'s block, or None (logged at debug level) if
        there is no block to write: no supervisor, or one that made none."""
        try:
            block = segments.attach_engine_stats(cfg, rank)
        except Exception as exc:
            log.debug("engine stats of rank %d not published: %s", rank, exc)
            return None
        try:
            return cls(block, slot)
        except Exception:
            block.close()
            log.debug("engine stats of rank %d not published", rank, exc_info=True)
            return None

    def write_due(self, fields: Callable[[], Fields], force: bool = False) -> None:
        """Write ``fields()`` if the last write is ``WRITE_INTERVAL_S`` old (or ``force``);
        ``fields`` is called only then. Never raises."""
        now = time.monotonic()
        if not force and now < self._due:
            return
        self._due = now + WRITE_INTERVAL_S
        try:
            values = {**self._zeros, **fields(), "pid": self._pid,
                      "pid_start": self._pid_start, "written": time.time()}
            self._block.write(self.slot, tuple(values[name] for name in self._names))
        except Exception:
            log.debug("writing engine stats failed", exc_info=True)

    def close(self) -> None:
        """Unmap the block (never unlinks: the supervisor owns it)."""
        try:
            self._block.close()
        except Exception:
            log.debug("closing the engine stats block failed", exc_info=True)
