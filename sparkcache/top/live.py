"""The live view: a frame redrawn in place (rich's Live, on the terminal's alternate
screen, as top does) every interval, and at once after a key. Keys are read one at a
time without echo (cbreak), and the terminal's settings are put back however the view
ends.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import termios
import tty
from collections.abc import Callable, Iterator

from rich.console import Console, RenderableType
from rich.live import Live

# key -> sort (sparkcache.top.gather.SORTS); "q" (and Ctrl-C) quits.
SORT_KEYS = {"c": "cpu", "m": "mem", "i": "io", "r": "rank", "o": "role"}
QUIT_KEYS = {"q", "Q", "\x03"}


@contextlib.contextmanager
def cbreak(fd: int | None) -> Iterator[None]:
    """Keys arrive one at a time, unechoed, while inside; nothing changes without a tty."""
    if fd is None:
        yield
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def read_key(fd: int | None, timeout: float) -> str | None:
    """One key pressed within ``timeout`` seconds, or None."""
    if fd is None:
        select.select([], [], [], timeout)
        return None
    ready, _, _ = select.select([fd], [], [], timeout)
    if not ready:
        return None
    data = os.read(fd, 32)
    if not data:  # stdin closed: nothing more will come
        select.select([], [], [], timeout)
        return None
    return data[:1].decode(errors="replace")


def run(draw: Callable[[str], RenderableType], interval: float, sort: str,
        console: Console | None = None) -> int:
    """Redraw ``draw(sort)`` every ``interval`` seconds until q; keys change the sort."""
    console = console or Console()
    fd = sys.stdin.fileno() if sys.stdin.isatty() else None
    with cbreak(fd), Live(draw(sort), console=console, screen=True, auto_refresh=False,
                          redirect_stdout=False, redirect_stderr=False) as live:
        while True:
            try:
                key = read_key(fd, interval)
            except KeyboardInterrupt:
                return 0
            if key in QUIT_KEYS:
                return 0
            if key is not None and key.lower() in SORT_KEYS:
                sort = SORT_KEYS[key.lower()]
            live.update(draw(sort), refresh=True)
