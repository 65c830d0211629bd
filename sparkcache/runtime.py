"""``<store>/runtime.json``: how ``status`` (and later tools) find a running
supervisor and its workers. The supervisor rewrites it (0600, atomically) whenever a
worker changes state and removes it when it stops. Kept apart from the supervisor so
readers need not import the workers (and torch).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import psutil

RUNTIME_FILE = "runtime.json"


def write(store_dir: Path, data: dict[str, Any]) -> None:
    path = store_dir / RUNTIME_FILE
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def read(store_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((store_dir / RUNTIME_FILE).read_text())
    except (OSError, ValueError):
        return None


def read_live(store_dir: Path) -> tuple[dict[str, Any] | None, bool]:
    """(runtime file, whether its supervisor is still running). A SIGKILLed supervisor
    leaves its file behind until the next one starts: its pid is then gone, or belongs to
    a process started at another time."""
    rt = read(store_dir)
    if rt is None:
        return None, False
    try:
        started = psutil.Process(int(rt["pid"])).create_time()
    except (psutil.Error, KeyError, TypeError, ValueError):
        return rt, False
    return rt, abs(started - float(rt.get("started", 0))) < 1.0
