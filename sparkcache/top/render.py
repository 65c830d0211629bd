"""Drawing a ``Frame`` (``sparkcache.top.gather``) with rich: a header (instance,
supervisor, health, keys), one row per worker and one per rank. The same renderable is
what the live view refreshes and what ``--once`` prints; ``to_json`` is ``--json``.
Laid out as psutil top views usually are: identity columns first (role, rank, pid,
cores), then the busy figures (CPU, memory, I/O, switches), then state and freshness.
"""

from __future__ import annotations

import dataclasses
import json
import time

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from sparkcache import activity
from sparkcache.top.gather import Frame, RankRow, WorkerRow

KEYS = "q quit  c CPU  m memory  i I/O  r rank  o role"
BAR_CELLS = 20


def size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{int(n)}B"


def _rate(n: float | None) -> str:
    return "-" if n is None else f"{size(n)}/s"


def _cores(cores: list[int] | None) -> str:
    """Affinity as ranges: 0-3,6."""
    if not cores:
        return "-"
    spans: list[list[int]] = []
    for c in sorted(cores):
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.1f}s" if s < 60 else f"{s / 60:.0f}m"


def _state(w: WorkerRow) -> Text:
    shown = w.state if w.report_state in (None, "READY") else f"{w.state}/{w.report_state}"
    style = "green" if w.up else ("red" if w.state in ("FATAL", "BACKOFF") else "yellow")
    return Text(shown, style=style)


def bar(used: int | None, limit: int, cells: int = BAR_CELLS) -> str:
    """``[#######.....] 12.3G/40.0G 31%`` of ``used`` against ``limit``; past the limit
    the bar is full and the share says by how much."""
    if used is None:
        return f"[{'?' * cells}] -/{size(limit)}"
    share = used / limit if limit else 0.0
    filled = min(cells, round(share * cells))
    return f"[{'#' * filled}{'.' * (cells - filled)}] {size(used)}/{size(limit)} {share:.0%}"


def _worker_table(frame: Frame) -> Table:
    t = Table(expand=False, box=None, pad_edge=False, header_style="bold reverse")
    for name, justify in (("ROLE", "left"), ("RANK", "right"), ("PID", "right"),
                          ("CORES", "left"), ("CPU%", "right"), ("RSS", "right"),
                          ("READ/s", "right"), ("WRITE/s", "right"), ("CTXSW/s", "right"),
                          ("STATE", "left"), ("BEAT", "right"), ("RESTARTS", "right")):
        t.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for w in frame.workers:
        p = w.process
        t.add_row(
            w.role, str(w.rank), "-" if w.pid is None else str(w.pid),
            _cores(p.cores if p else None),
            "-" if p is None or p.cpu_percent is None else f"{p.cpu_percent:.1f}",
            size(p.rss_bytes if p else None),
            _rate(p.read_bytes_per_s if p else None), _rate(p.write_bytes_per_s if p else None),
            "-" if p is None or p.ctx_switches_per_s is None else f"{p.ctx_switches_per_s:.0f}",
            _state(w), _age(w.heartbeat_age_s), str(w.restarts),
        )
    return t


def _rings(r: RankRow) -> str:
    busy = [f"{name}={n}" for name, n in r.rings.items() if n]
    return " ".join(busy) if busy else "empty"


def _rank_table(frame: Frame) -> Table:
    t = Table(expand=False, box=None, pad_edge=False, header_style="bold reverse")
    for name in ("RANK", "SLOTS free/cap/com", "PENDING", "OLDEST", "RESTORES q/fl",
                 "BACKLOG", "DUTY", "ENTRIES", "USED / MAX", "RINGS"):
        t.add_column(name, no_wrap=True)
    for r in frame.ranks:
        s = r.slots
        slots = f"{s.get('free', 0)}/{s.get('capture', 0)}/{s.get('commit', 0)}"
        backlog = size(r.backlog_bytes)
        if r.selected_roots:
            backlog += f" sel={r.selected_roots}"
        if r.episode_s:
            backlog += f" ep={_age(r.episode_s)}"
        used = Text(bar(r.used_bytes, r.max_bytes))
        if r.refusing:
            used.stylize("bold red")
        elif r.used_bytes is not None and r.used_bytes > r.max_bytes:
            used.stylize("yellow")
        t.add_row(
            str(r.rank), slots, f"{r.pending_publications} ({size(r.pending_bytes)})",
            _age(r.oldest_pending_s), f"{r.restores_queued}/{r.restores_in_flight}",
            backlog, "-" if r.duty is None else f"{r.duty:.0%}",
            "-" if r.entries is None else str(r.entries), used,
            _rings(r) + (" REFUSING" if r.refusing else ""),
        )
    return t


def metrics_url(address: dict) -> str:
    """``http://host:port`` of runtime.json's ``metrics``; an IPv6 host in brackets, or
    the port would read as part of it."""
    host = str(address["host"])
    return f"http://{f'[{host}]' if ':' in host else host}:{address['port']}"


def header(frame: Frame, interval: float | None = None) -> Text:
    when = time.strftime("%H:%M:%S", time.localtime(frame.at))
    metrics = "off" if not frame.metrics else f"{metrics_url(frame.metrics)}/metrics"
    up = sum(w.up for w in frame.workers)
    text = Text()
    text.append(f"sparkcache top - {when}  instance {frame.instance}  supervisor pid "
                f"{frame.supervisor_pid}  store {frame.store_dir}\n", style="bold")
    text.append(f"workers {up}/{len(frame.workers)} up  metrics {metrics}  health ")
    text.append("ok" if frame.healthy else "NOT OK", style="green" if frame.healthy else "red")
    if not frame.healthy:
        text.append(": " + "; ".join(frame.health.splitlines()))
    if frame.activity is not None:
        for line in activity.lines(frame.activity, frame.at):
            text.append(f"\n{line}")
    every = "" if interval is None else f"  every {interval:g}s"
    text.append(f"\nsort {frame.sort}{every}  [{KEYS}]", style="dim")
    return text


def render(frame: Frame, interval: float | None = None) -> RenderableType:
    return Group(header(frame, interval), Text(""), _worker_table(frame), Text(""),
                 _rank_table(frame))


def to_json(frame: Frame) -> str:
    return json.dumps(dataclasses.asdict(frame))
