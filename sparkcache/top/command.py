"""``sparkcache top`` as the CLI runs it: find the instance, then one frame (``--once``),
its JSON (``--json``) or the live view. Prints; returns the exit code (1 when no
supervisor runs or its segments cannot be read)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.text import Text

from sparkcache.instance import Instance, NoSupervisor
from sparkcache.shm import SegmentError
from sparkcache.top import live
from sparkcache.top.gather import SORTS, ProcessSampler, gather
from sparkcache.top.render import KEYS, render, to_json

# Without a terminal (a pipe, a file) rich would wrap the tables at 80 columns.
PIPE_WIDTH = 200
# The longest --interval: time.sleep and select refuse what cannot be a timeout.
MAX_INTERVAL_S = 3600.0


def _open(store_dir: Path) -> Instance:
    try:
        return Instance.open(store_dir)
    except SegmentError as exc:
        raise NoSupervisor(f"cannot read the running instance's segments: {exc}") from None


def once(store_dir: Path, fallback: Any, interval: float, sort: str, json_out: bool) -> int:
    """One frame, its rates measured over ``interval`` seconds."""
    try:
        inst = _open(store_dir)
    except NoSupervisor as exc:
        print(f"sparkcache: {exc}", file=sys.stderr)
        return 1
    with inst:
        sampler = ProcessSampler()
        settings = inst.settings(fallback)
        gather(inst, sampler, settings, sort)  # the baseline of every rate
        time.sleep(interval)
        inst.refresh()
        frame = gather(inst, sampler, settings, sort)
    if json_out:
        print(to_json(frame))
    else:
        console = Console(width=None if sys.stdout.isatty() else PIPE_WIDTH)
        console.print(render(frame))
    return 0


class _Viewer:
    """Keeps the instance attached between frames; re-attaches when the supervisor is
    replaced, and says so while none runs."""

    def __init__(self, store_dir: Path, fallback: Any, interval: float) -> None:
        self.store_dir, self.fallback, self.interval = store_dir, fallback, interval
        self.inst: Instance | None = None
        self.sampler = ProcessSampler()

    def draw(self, sort: str) -> RenderableType:
        if self.inst is not None and not self.inst.refresh():
            self.inst.close()
            self.inst = None
        if self.inst is None:
            try:
                self.inst = _open(self.store_dir)
                self.sampler = ProcessSampler()
            except NoSupervisor as exc:
                return Group(Text(f"sparkcache top - {time.strftime('%H:%M:%S')}",
                                  style="bold"),
                             Text(f"{exc}; looking again every {self.interval:g}s"),
                             Text(f"[{KEYS}]", style="dim"))
        frame = gather(self.inst, self.sampler, self.inst.settings(self.fallback), sort)
        return render(frame, self.interval)

    def close(self) -> None:
        if self.inst is not None:
            self.inst.close()
            self.inst = None


def main(store_dir: Path, fallback: Any, *, once_: bool, json_out: bool, interval: float,
         sort: str) -> int:
    if not 0 < interval <= MAX_INTERVAL_S:  # nan and inf too: sleep cannot wait them
        print(f"sparkcache: --interval={interval}: expected seconds above 0 and at most "
              f"{MAX_INTERVAL_S:g}, such as 2", file=sys.stderr)
        return 2
    if sort not in SORTS:
        print(f"sparkcache: --sort={sort!r}: expected one of {', '.join(SORTS)}",
              file=sys.stderr)
        return 2
    if once_ or json_out:
        return once(store_dir, fallback, interval, sort, json_out)
    try:
        _open(store_dir).close()  # no supervisor: say so in one line, as --once does
    except NoSupervisor as exc:
        print(f"sparkcache: {exc}", file=sys.stderr)
        return 1
    viewer = _Viewer(store_dir, fallback, interval)
    try:
        return live.run(viewer.draw, interval, sort)
    finally:
        viewer.close()
