"""A running instance seen from another process (``status``, ``top``, ``sizing``): found
through ``<store>/runtime.json``, its rank segments attached read-only (an observer's
mappings: nothing is written, nothing is unlinked on close), and read with the same
``sparkcache.metrics.reading`` the supervisor's ``/metrics`` and ``/healthz`` use, so the
figures and the health verdict are the endpoint's.

What the supervisor knows of its workers (state, pid, restarts) comes from runtime.json,
which it rewrites whenever one changes; ``refresh`` re-reads it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkcache import runtime, segments
from sparkcache.metrics import reading
from sparkcache.metrics.carry import Carry
from sparkcache.metrics.reading import Reading, WorkerInfo
from sparkcache.segments import RankSegments
from sparkcache.shm import Ring, SegmentError, SlotArena, StatsBlock
from sparkcache.shm.layouts import ENGINE_STATS, WORKER_STATS
from sparkcache.workers.lifecycle import Role

log = logging.getLogger(__name__)


class NoSupervisor(RuntimeError):
    """No supervisor runs on this store dir (one line, for the CLI to print)."""


@dataclass(frozen=True)
class RuntimeView:
    """One reading of runtime.json, of a supervisor that is running."""

    data: dict[str, Any]

    @property
    def pid(self) -> int:
        return int(self.data["pid"])

    @property
    def pid_start(self) -> float:
        return float(self.data.get("pid_start", 0.0))

    @property
    def instance(self) -> str:
        return str(self.data["instance"])

    @property
    def ranks(self) -> int:
        return int(self.data["ranks"])

    @property
    def metrics(self) -> dict[str, Any] | None:
        return self.data.get("metrics")

    def worker_infos(self) -> list[WorkerInfo]:
        """The supervisor's workers as ``reading`` wants them. The carry is empty: the
        totals of a worker's dead processes live in the supervisor, so a reader here
        sees each worker's current process's counters only."""
        infos = []
        for w in self.data.get("workers", []):
            role = str(w["role"])
            infos.append(WorkerInfo(
                rank=int(w["rank"]), role=role, slot=int(Role[role.upper()]),
                name=str(w["name"]), state=str(w["state"]),
                pid=None if w.get("pid") is None else int(w["pid"]),
                restarts=int(w.get("restarts", 0)), last_exit=w.get("last_exit"),
                carry=Carry(),
            ))
        return infos

    def worker_cpus(self) -> dict[str, list[int]]:
        """Worker name -> the cores the supervisor pinned it to."""
        return {str(w["name"]): list(w.get("cpus") or []) for w in self.data.get("workers", [])}


def running(store_dir: Path) -> RuntimeView:
    """The running supervisor's runtime.json, or NoSupervisor saying why there is none."""
    rt, alive = runtime.read_live(store_dir)
    if rt is None:
        raise NoSupervisor(
            f"no supervisor runs on {store_dir} (no {runtime.RUNTIME_FILE}); start one with "
            "`sparkcache supervise`, or name its store with --store-dir / SPARKCACHE_STORE_DIR"
        )
    elsewhere = runtime.other_namespace(rt)
    if elsewhere is not None:
        raise NoSupervisor(f"cannot watch the supervisor of {store_dir} from here: {elsewhere}")
    if not alive:
        raise NoSupervisor(
            f"no supervisor runs on {store_dir}: {runtime.RUNTIME_FILE} was left by pid "
            f"{rt.get('pid')}, which is gone (the next start replaces it)"
        )
    return RuntimeView(rt)


def _attach_rank(instance: str, rank: int) -> RankSegments:
    """Observer mappings of one rank's segments; on failure, what was mapped is dropped."""
    made: list[Any] = []
    try:
        rings = {}
        for role, (layout, _) in segments.RINGS.items():
            rings[role] = Ring.attach(segments.name(instance, rank, role), layout)
            made.append(rings[role])
        arena = SlotArena.attach(segments.name(instance, rank, segments.ARENA))
        made.append(arena)
        stats = StatsBlock.attach(segments.name(instance, rank, segments.STATS), WORKER_STATS)
        made.append(stats)
        engine = _attach_engine(instance, rank)
    except BaseException:
        for seg in made:
            seg.close()
        raise
    return RankSegments(rank, rings, arena, stats, engine)


def _attach_engine(instance: str, rank: int) -> StatsBlock | None:
    """The rank's engine stats block, or None: a supervisor of an older version made
    none, and the workers' figures are still worth showing without the engine's."""
    try:
        return StatsBlock.attach(segments.name(instance, rank, segments.ENGINE), ENGINE_STATS)
    except Exception as exc:
        log.debug("no engine stats block for rank %d: %s", rank, exc)
        return None


class Instance:
    """A running supervisor's segments, attached read-only. ``open`` raises NoSupervisor
    when none runs and SegmentError when its segments cannot be attached."""

    def __init__(self, store_dir: Path, rt: RuntimeView, segs: list[RankSegments]) -> None:
        self.store_dir = store_dir
        self.runtime = rt
        self.segments = segs

    @classmethod
    def open(cls, store_dir: Path) -> Instance:
        rt = running(store_dir)
        segs: list[RankSegments] = []
        try:
            for rank in range(rt.ranks):
                segs.append(_attach_rank(rt.instance, rank))
        except BaseException:
            for seg in segs:
                _detach(seg)
            raise
        return cls(store_dir, rt, segs)

    def refresh(self) -> bool:
        """Re-read runtime.json. False once the supervisor attached to is gone or replaced
        (its segments are then unlinked: what these mappings show is no longer live)."""
        rt, alive = runtime.read_live(self.store_dir)
        if rt is None or not alive:
            return False
        fresh = RuntimeView(rt)
        if (fresh.pid, fresh.pid_start) != (self.runtime.pid, self.runtime.pid_start):
            return False
        self.runtime = fresh
        return True

    def read(self) -> Reading:
        """One reading now, as the supervisor's endpoint would take it."""
        return reading.read_from(self.segments, self.runtime.worker_infos())

    def settings(self, fallback: Any) -> dict[str, float]:
        """The supervisor's capacity settings (runtime.json), each one a supervisor of an
        older version did not write taken from ``fallback`` (a Config)."""
        given = self.runtime.data.get("settings") or {}
        return {name: given.get(name, getattr(fallback, name))
                for name in runtime.RUNTIME_SETTINGS}

    def close(self) -> None:
        """Drop the mappings (never unlinks: the supervisor owns the segments)."""
        segs, self.segments = self.segments, []
        for seg in segs:
            _detach(seg)

    def __enter__(self) -> Instance:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _detach(seg: RankSegments) -> None:
    # RankSegments.close unlinks only what this process created; attached, it unmaps.
    seg.close()


__all__ = ["Instance", "NoSupervisor", "RuntimeView", "SegmentError", "running"]
