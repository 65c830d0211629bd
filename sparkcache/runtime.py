"""``<store>/runtime.json``: how ``status`` (and later tools) find a running
supervisor and its workers. The supervisor rewrites it (0600, atomically) whenever a
worker changes state and removes it when it stops. Kept apart from the supervisor so
readers need not import the workers (and torch). Written inside the checked store dir
without following links (``sparkcache.store.layout.write_file``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from shm.segment import creator_alive
from sparkcache.store import StoreError, layout

RUNTIME_FILE = "runtime.json"
# Settings the supervisor repeats under "settings" (numbers only): what ``status``,
# ``top`` and ``sizing`` read of the instance they look at, rather than their own
# environment's values.
RUNTIME_SETTINGS = (
    "max_bytes", "low_watermark_bytes", "lease_seconds", "maintenance_slice_bytes",
    "maintenance_slice_ms", "maintenance_duty", "maintenance_io_bytes_per_s",
)


class OtherPidNamespace(RuntimeError):
    """The supervisor runs in another PID namespace than this process."""


def pid_namespace() -> str | None:
    """This process's PID namespace as ``/proc/self/ns/pid`` names it (``pid:[<inode>]``),
    or None where that cannot be read."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def other_pid_namespace(rt: dict[str, Any] | None) -> str | None:
    """Why the supervisor of ``rt`` (runtime.json) cannot be judged from this process: it
    runs in another PID namespace, where its pid names another process or none. None
    when they share one, or when there is nothing to compare (no runtime file, an older
    one without the field, no /proc)."""
    theirs = (rt or {}).get("pid_namespace")
    ours = pid_namespace()
    if not (theirs and ours and theirs != ours):
        return None
    return (f"the supervisor (pid {(rt or {}).get('pid')}) runs in PID namespace {theirs} "
            f"and this process in {ours}: SparkCache's processes must share one (docker run "
            "--pid=host, or --pid=container:<the other>; in Kubernetes, one pod with "
            "shareProcessNamespace: true)")


def check_pid_namespace(rt: dict[str, Any] | None) -> None:
    """Raise OtherPidNamespace if the supervisor of ``rt`` runs in another PID namespace
    than this process (``other_pid_namespace``). Each side judges the other's processes
    alive or dead by the pids they record (ring ends, KV registrations and segments, a
    load's restore worker); across namespaces a live one is taken for dead: capture
    dropped a live engine's registration and unlinked its KV segment, and a load whose
    worker was taken for dead could still be written into blocks vLLM had reused."""
    why = other_pid_namespace(rt)
    if why is not None:
        raise OtherPidNamespace(why)


def write(store_dir: Path, data: dict[str, Any]) -> None:
    """Atomically replace ``runtime.json`` (0600) in ``store_dir``, which must be safe
    (UnsafeStoreDir otherwise)."""
    dir_fd = layout.open_store_dir(store_dir, create=False)
    try:
        layout.write_file(dir_fd, RUNTIME_FILE, json.dumps(data).encode())
    finally:
        os.close(dir_fd)


def read(store_dir: Path) -> dict[str, Any] | None:
    """``runtime.json`` as written, or None when there is none a supervisor could have
    written (absent, unreadable, not JSON, or JSON but not an object, or in a store dir
    that is not safe, where a supervisor writes nothing)."""
    try:
        data = json.loads(layout.read_file(store_dir, RUNTIME_FILE))
    except (OSError, ValueError, StoreError):
        return None
    return data if isinstance(data, dict) else None


def read_live(store_dir: Path) -> tuple[dict[str, Any] | None, bool]:
    """(runtime file, whether its supervisor is still running). A SIGKILLed supervisor
    leaves its file behind until the next one starts: its pid is then gone, or belongs to
    a process started at another time."""
    rt = read(store_dir)
    if rt is None:
        return None, False
    try:
        pid, start = int(rt["pid"]), float(rt["pid_start"])
    except (KeyError, TypeError, ValueError):
        return rt, False  # not one this version writes: its supervisor is not told apart
    return rt, pid > 0 and start != 0.0 and creator_alive(pid, start)
