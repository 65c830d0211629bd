"""What the store did for its engines over the last minute and since the supervisor
started: restores, the bytes they wrote into KV blocks, and the prefix hit rate with its
denominator (tokens looked up). ``status`` is one look, so the supervisor keeps the
history: it samples the counters every ``SAMPLE_S`` and writes ``activity.json`` into the
store dir, which ``status`` and ``top`` read (docs/operations.md, "Is it hitting?").

The counters come from the rank's stats blocks: the engines' lookups (every engine-side
writer: vLLM's scheduler and each rank's client, each counting from 0 in its process) and
each restore worker's loads served and bytes written (carried across its restarts). A
counter that went down belongs to a process that restarted: its new value is what it
counted since."""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkcache.runtime import ACTIVITY_FILE, read_object
from sparkcache.sizing import size
from sparkcache.store import layout

if TYPE_CHECKING:  # the reading imports the workers' modules, which status does not need
    from sparkcache.metrics.reading import Reading

SAMPLE_S = 5.0
WINDOW_S = 60.0
# Figures of each source: engine-side lookups, and what the restore workers did.
ENGINE_FIELDS = {"lookups": "lookups", "lookup_tokens": "lookup_tokens",
                 "hit_tokens": "lookup_hit_tokens"}
RESTORE_FIELDS = {"restores": "processed", "restore_failures": "failed",
                  "restored_bytes": "copy_bytes"}
FIELDS = (*ENGINE_FIELDS, *RESTORE_FIELDS)


def read_counters(reading: Reading) -> dict[tuple, dict[str, float]]:
    """Each source's counters in ``reading``: (``"engine"``, rank, writer), with the
    writing process's start (``process_start``) as ``"start"``, and (``"restore"``,
    rank), whose totals are this supervisor's own (carried across restarts)."""
    out: dict[tuple, dict[str, float]] = {}
    for e in reading.engines:
        out[("engine", e.rank, e.writer)] = {
            "start": float(e.record.pid_start),
            **{name: float(getattr(e.record, src)) for name, src in ENGINE_FIELDS.items()}}
    for w in reading.workers:
        if w.info.role == "restore":
            out[("restore", w.info.rank)] = {
                "start": 0.0,
                **{name: float(w.totals.get(src, 0.0)) for name, src in RESTORE_FIELDS.items()}}
    return out


@dataclass
class Activity:
    """Totals since ``started``, and their values over the last ``WINDOW_S``."""

    started: float  # time.time() of the supervisor's start
    # Its process's start (``process_start``): an engine that started later counted
    # nothing before it; one that started earlier, only what it counts from its first
    # sample is this supervisor's.
    born: float = 0.0
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(FIELDS, 0.0))
    _last: dict[tuple, dict[str, float]] = field(default_factory=dict)
    _history: deque[tuple[float, dict[str, float]]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        # The minute of a supervisor younger than one is since its start.
        self._history.append((self.started, dict(self.totals)))

    def sample(self, counters: Mapping[tuple, Mapping[str, float]], now: float) -> None:
        """Add what each source counted since the last sample; a source's ``"start"``
        is its process's (0: counting for this supervisor from the first)."""
        for source, values in counters.items():
            last = self._last.get(source)
            if last is None and 0 < values.get("start", 0.0) < self.born:
                last = values  # an engine older than this supervisor: from now on
            for name in FIELDS:
                if name in values:
                    grew = values[name] - (last or {}).get(name, 0.0)
                    self.totals[name] += grew if grew >= 0 else values[name]
            self._last[source] = dict(values)
        self._history.append((now, dict(self.totals)))
        # Keep one sample at least WINDOW_S old: the minute's baseline.
        while len(self._history) > 1 and now - self._history[1][0] >= WINDOW_S:
            self._history.popleft()

    def summary(self, now: float) -> dict[str, Any]:
        """Totals since the start and over the last minute (or since the start, if it
        is younger), with the seconds each covers."""
        base_at, base = self._history[0]
        minute = {k: self.totals[k] - base.get(k, 0.0) for k in FIELDS}
        return {"written": now, "started": self.started, "totals": dict(self.totals),
                "minute": minute, "minute_s": now - base_at}


def write(store_dir_fd: int, summary: Mapping[str, Any]) -> None:
    """Replace ``activity.json`` (0600, atomically) in the store dir open as
    ``store_dir_fd``: the one the supervisor locked, never another put at its path."""
    layout.write_file(store_dir_fd, ACTIVITY_FILE, json.dumps(summary).encode())


def read(store_dir: Path) -> dict[str, Any] | None:
    """``activity.json`` as written, or None (none, unreadable, not an object)."""
    data = read_object(store_dir, ACTIVITY_FILE)
    return data if data is not None and isinstance(data.get("totals"), dict) else None


def hit_rate(figures: Mapping[str, float]) -> str:
    """``"93% of 120k tokens"``: hit tokens over tokens looked up, with the denominator."""
    looked = figures.get("lookup_tokens", 0.0)
    if not looked:
        return "no tokens looked up"
    return f"{figures.get('hit_tokens', 0.0) / looked:.0%} of {_count(looked)} tokens"


def _count(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{int(n)}"


def lines(data: Mapping[str, Any], now: float | None = None) -> list[str]:
    """What ``status`` prints of an ``activity.json``: the last minute, then since the
    start."""
    now = time.time() if now is None else now
    out = []
    for label, figures, seconds in (
            (f"last {data.get('minute_s', 0):.0f}s", data.get("minute") or {}, None),
            ("since start", data["totals"], now - float(data.get("started", now)))):
        span = "" if seconds is None else f" ({_duration(seconds)})"
        restored = figures.get("restored_bytes", 0.0)
        out.append(
            f"{label}{span}: restores={int(figures.get('restores', 0))} "
            f"restored={size(restored)} failed={int(figures.get('restore_failures', 0))} "
            f"lookups={int(figures.get('lookups', 0))} hit rate {hit_rate(figures)}")
    return out


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f}h"
    if seconds >= 60:
        return f"{seconds / 60:.0f}m"
    return f"{seconds:.0f}s"

