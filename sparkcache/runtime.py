"""``<store>/runtime.json``: how ``status`` (and later tools) find a running
supervisor and its workers. The supervisor rewrites it (0600, atomically) whenever a
worker changes state and removes it when it stops. Kept apart from the supervisor so
readers need not import the workers (and torch). Written inside the checked store dir
without following links (``sparkcache.store.layout.write_file``).
"""

from __future__ import annotations

import json
import logging
import multiprocessing.util
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any

from sparkcache.shm.segment import creator_alive
from sparkcache.store import StoreError, layout

log = logging.getLogger(__name__)

RUNTIME_FILE = "runtime.json"
# What the running supervisor did lately (``sparkcache.activity``), and the capacity
# settings of the last one to run, kept after it stops (what ``status`` shows then).
ACTIVITY_FILE = "activity.json"
SETTINGS_FILE = "settings.json"
# ``layout.write_file``'s temporary copies of the supervisor's files.
_TEMP_RE = re.compile(
    rf"^\.({'|'.join(re.escape(n) for n in (RUNTIME_FILE, ACTIVITY_FILE, SETTINGS_FILE))})"
    rf"\.[0-9a-f]{{16}}{re.escape(layout.TEMP_SUFFIX)}$")
# Settings the supervisor repeats under "settings" (numbers only): what ``status``,
# ``top`` and ``sizing`` read of the instance they look at, rather than their own
# environment's values.
RUNTIME_SETTINGS = (
    "max_bytes", "low_watermark_bytes", "lease_seconds", "maintenance_slice_bytes",
    "maintenance_slice_ms", "maintenance_duty", "maintenance_duty_max",
    "maintenance_io_bytes_per_s",
)


class OtherNamespace(RuntimeError):
    """The supervisor runs in another PID namespace than this process, or reads time
    since boot shifted from it (another time namespace)."""


def pid_namespace() -> str | None:
    """This process's PID namespace as ``/proc/self/ns/pid`` names it (``pid:[<inode>]``),
    or None where that cannot be read."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def boottime_offset() -> float | None:
    """The shift this process's time namespace gives time since boot, in seconds (0.0
    where the kernel has no time namespaces), or None where it cannot be read."""
    try:
        with open("/proc/self/timens_offsets") as f:
            for line in f:
                clock, seconds, nanos = line.split()
                if clock == "boottime":
                    return int(seconds) + int(nanos) / 1e9
    except FileNotFoundError:
        return 0.0
    except (OSError, ValueError):
        return None
    return 0.0


def other_namespace(rt: dict[str, Any] | None) -> str | None:
    """Why the supervisor of ``rt`` (runtime.json) cannot be judged from this process: it
    runs in another PID namespace, where its pid names another process or none, or in a
    time namespace that shifts time since boot otherwise than this one's, so that every
    start time recorded beside a pid reads differently (``shm.segment.process_start``).
    None when both match, or when there is nothing to compare (no runtime file, an older
    one without the fields, no /proc)."""
    rt = rt or {}
    theirs, ours = rt.get("pid_namespace"), pid_namespace()
    if theirs and ours and theirs != ours:
        return (f"the supervisor (pid {rt.get('pid')}) runs in PID namespace {theirs} "
                f"and this process in {ours}: SparkCache's processes must share one (docker "
                "run --pid=host, or --pid=container:<the other>; in Kubernetes, one pod "
                "with shareProcessNamespace: true)")
    theirs, ours = rt.get("boottime_offset"), boottime_offset()
    if isinstance(theirs, int | float) and ours is not None and theirs != ours:
        return (f"the supervisor (pid {rt.get('pid')}) reads time since boot shifted by "
                f"{theirs:g} s and this process by {ours:g} s (another time namespace): "
                "SparkCache's processes must read it alike, or each takes the other's "
                "live processes for dead (run the containers without a time namespace "
                "of their own)")
    return None


def check_namespace(rt: dict[str, Any] | None) -> None:
    """Raise OtherNamespace if the supervisor of ``rt`` runs in another PID or time
    namespace than this process (``other_namespace``). Each side judges the other's processes
    alive or dead by the pids they record (ring ends, KV registrations and segments, a
    load's restore worker); across namespaces a live one is taken for dead: capture
    dropped a live engine's registration and unlinked its KV segment, and a load whose
    worker was taken for dead could still be written into blocks vLLM had reused."""
    why = other_namespace(rt)
    if why is not None:
        raise OtherNamespace(why)


def write(store_dir: Path, data: dict[str, Any]) -> None:
    """Atomically replace ``runtime.json`` (0600) in ``store_dir``, which must be safe
    (UnsafeStoreDir otherwise)."""
    dir_fd = layout.open_store_dir(store_dir, create=False)
    try:
        layout.write_file(dir_fd, RUNTIME_FILE, json.dumps(data).encode())
    finally:
        os.close(dir_fd)


def write_settings(store_dir_fd: int, settings: dict[str, Any]) -> None:
    """Keep the capacity settings a supervisor runs with in ``settings.json`` (0600,
    atomically) in the store dir open as ``store_dir_fd``: ``status`` shows them once it
    has stopped, rather than its own environment's defaults."""
    layout.write_file(store_dir_fd, SETTINGS_FILE, json.dumps(settings).encode())


def read_object(store_dir: Path, name: str) -> dict[str, Any] | None:
    """The JSON object a supervisor wrote as ``name`` in ``store_dir``, or None when there
    is none it could have written (absent, unreadable, not JSON, or JSON but not an
    object, or in a store dir that is not safe, where a supervisor writes nothing)."""
    try:
        data = json.loads(layout.read_file(store_dir, name))
    except (OSError, ValueError, StoreError):
        return None
    return data if isinstance(data, dict) else None


def last_settings(store_dir: Path) -> dict[str, Any] | None:
    """The settings the last supervisor of ``store_dir`` ran with, or None."""
    return read_object(store_dir, SETTINGS_FILE)


def read(store_dir: Path) -> dict[str, Any] | None:
    """``runtime.json`` as written, or None (``read_object``)."""
    return read_object(store_dir, RUNTIME_FILE)


def supervisor_identity(rt: dict[str, Any] | None) -> tuple | None:
    """The supervisor a ``runtime.json`` (from ``read``) names: its pid and start time;
    None for none."""
    return (rt.get("pid"), rt.get("pid_start")) if rt else None


def names_supervisor(store_dir: Path, identity: tuple | None) -> bool:
    """Whether ``store_dir``'s ``runtime.json`` names the supervisor ``identity`` (from
    ``supervisor_identity``): a worker found down under it is restarted in place, so
    handles of its segments stay good."""
    return identity == supervisor_identity(read(store_dir))


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


def mp_temp_dir() -> str:
    """The directory multiprocessing keeps this process's fork-server socket in (made on
    first use): recorded in the runtime file, so that the next supervisor removes it if
    this one is SIGKILLed (``remove_leftovers``)."""
    return multiprocessing.util.get_temp_dir()


def remove_leftovers(store_dir_fd: int, previous: dict[str, Any] | None) -> list[str]:
    """Remove what a SIGKILLed supervisor left; call holding the store's lock, so that
    no live supervisor owns any of it. Its runtime file's temporary copies (a kill
    inside ``write_file``) in the store dir open as ``store_dir_fd``, and the
    multiprocessing directory its runtime file ``previous`` names: a ``pymp-*``
    directory of this user's, never followed through a link. Returns what went."""
    gone = []
    for name in os.listdir(store_dir_fd):
        if _TEMP_RE.match(name):
            try:
                os.unlink(name, dir_fd=store_dir_fd)
                gone.append(name)
            except FileNotFoundError:
                pass
    mp_dir = previous.get("mp_temp_dir") if previous else None
    if isinstance(mp_dir, str) and os.path.isabs(mp_dir) and \
            os.path.basename(mp_dir).startswith("pymp-") and mp_dir != mp_temp_dir():
        try:
            st = os.lstat(mp_dir)
        except OSError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            shutil.rmtree(mp_dir, ignore_errors=True)
            gone.append(mp_dir)
    if gone:
        log.info("removed what a killed supervisor left: %s", gone)
    return gone
