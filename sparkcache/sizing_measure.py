"""The figures ``sparkcache sizing`` measures on a running instance: each rank's
maintenance record read at both ends of a window (rates from its counters and gauges), and
each rank's index for the largest and mean root.

Net growth over the window: used bytes are retained bytes plus bytes awaiting collection,
and eviction moves bytes from the first to the second (``reclaimed_bytes``), so what the
store would have grown by without eviction is
``d(used) - d(collectable) + d(reclaimed)``: bytes commits added less what superseding
freed.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sparkcache.instance import Instance
from sparkcache.shm import SegmentError
from sparkcache.store import StoreError, index
from sparkcache.store.layout import RankLayout


class MeasureError(RuntimeError):
    """The window could not be measured (one line saying why)."""


@dataclass(frozen=True)
class RankRates:
    rank: int
    window_s: float
    net_growth_bytes_per_s: float
    reclaim_bytes_per_s: float  # what eviction reclaimed over the window
    in_episode: bool  # a pressure episode ran through the whole window
    duty: float  # maintenance's share of the last 10 s in slices, at the window's end
    used_bytes: int
    entries: int


@dataclass(frozen=True)
class Measured:
    supervisor_pid: int
    window_s: float
    ranks: list[RankRates]
    largest_root_bytes: int | None  # the largest publication the index holds
    mean_root_bytes: float | None
    settings: dict[str, float]  # the supervisor's (runtime.json)


def _records(inst: Instance) -> dict[int, tuple]:
    """Rank -> maintenance's record, of its current process only."""
    out = {}
    for w in inst.read().workers:
        if w.info.role == "maintenance":
            if not (w.live and w.record is not None):
                raise MeasureError(f"maintenance of rank {w.info.rank} has no live report "
                                   f"({w.why_down or 'not started'}); measure again later")
            out[w.info.rank] = w.record
    return out


def _rates(rank: int, a: tuple, b: tuple) -> RankRates:
    if (int(a.pid), float(a.pid_start)) != (int(b.pid), float(b.pid_start)):
        raise MeasureError(f"maintenance of rank {rank} restarted during the window; "
                           "measure again")
    dt = float(b.heartbeat) - float(a.heartbeat)
    if dt <= 0:
        raise MeasureError(f"maintenance of rank {rank} did not report during the window "
                           "(stopped?); measure again with a longer --window")
    grew = (int(b.used_bytes) - int(a.used_bytes)
            - (int(b.collectable_bytes) - int(a.collectable_bytes))
            + (int(b.reclaimed_bytes) - int(a.reclaimed_bytes)))
    return RankRates(
        rank=rank, window_s=dt, net_growth_bytes_per_s=grew / dt,
        reclaim_bytes_per_s=(int(b.reclaimed_bytes) - int(a.reclaimed_bytes)) / dt,
        in_episode=bool(a.episode_since) and float(a.episode_since) == float(b.episode_since),
        duty=float(b.duty), used_bytes=int(b.used_bytes), entries=int(b.entries),
    )


def root_sizes(store_dir: Path, ranks: int) -> tuple[int | None, float | None]:
    """(largest root's bytes, mean root bytes) over every rank's index; None when empty.
    MAX reads the roots table once (no index on bytes): one scan, off the serving path."""
    largest, count, total = None, 0, 0
    for rank in range(ranks):
        try:
            conn = index.connect(RankLayout(store_dir, rank).index_path, create=False,
                                 readonly=True)
        except (OSError, StoreError, sqlite3.Error):  # a rank never committed to: no index
            continue
        try:
            (biggest,) = conn.execute("SELECT MAX(bytes) FROM roots").fetchone()
            n, b = conn.execute("SELECT count, bytes FROM totals WHERE name = 'roots'"
                                ).fetchone()
        finally:
            conn.close()
        if biggest is not None:
            largest = max(largest or 0, int(biggest))
        count, total = count + int(n), total + int(b)
    return largest, (total / count if count else None)


def measure(store_dir: Path, window_s: float, fallback: object,
            sleep: Callable[[float], None] = time.sleep) -> Measured:
    """Measure the running instance on ``store_dir`` over ``window_s`` seconds.
    NoSupervisor when none runs; MeasureError when a rank cannot be measured or the
    supervisor's segments cannot be read (a supervisor stopping has unlinked them)."""
    try:
        opened = Instance.open(store_dir)
    except SegmentError as exc:
        raise MeasureError(f"cannot read the running instance's segments: {exc}") from None
    with opened as inst:
        first = _records(inst)
        sleep(window_s)
        if not inst.refresh():
            raise MeasureError("the supervisor stopped during the window")
        second = _records(inst)
        settings = inst.settings(fallback)
        pid, ranks = inst.runtime.pid, inst.runtime.ranks
    rates = [_rates(rank, first[rank], second[rank]) for rank in sorted(second)
             if rank in first]
    largest, mean = root_sizes(store_dir, ranks)
    return Measured(pid, window_s, rates, largest, mean, settings)
