"""``kv-r<r>.json``: the descriptor of the KV tensors an engine rank registered
(``sparkcache.kvmem.describe``, plus its registration generation and block dimension),
written by the client and read by the workers that open the tensors. Apart from kvmem so
that a reader need not import torch to learn whether, and what, is registered.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from pathlib import Path
from typing import Any

import psutil

from sparkcache.shm.segment import SHM_DIR
from sparkcache.store import StoreError, layout

log = logging.getLogger(__name__)

# The files of /dev/shm a CUDA engine's sharing leaves when its process ends before the
# processes that opened its tensors (2026-12-04, an H200, torch 2.11): torch's reference
# counts, named in each ``storage._share_cuda_()`` (``ref_counter_handle``,
# torch_<pid>_<random>_<n>), and the CUDA driver's own, cuda.shm.<n>.<pid in hex>.<n>.
_TORCH_REF_FILE = re.compile(r"torch_[0-9]{1,10}_[0-9]{1,20}_[0-9]{1,10}")
_DRIVER_IPC_FILE = "cuda.shm.*.{pid:x}.*"
_DRIVER_IPC_RE = re.compile(r"cuda\.shm\.[0-9a-f]{1,8}\.([0-9a-f]{1,8})\.[0-9]{1,10}")


def registry_path(store_dir: Path, rank: int) -> Path:
    return store_dir / f"kv-r{rank}.json"


def write_registry(store_dir: Path, rank: int, reg_gen: int, block_dim: int,
                   desc: dict[str, Any]) -> None:
    """Atomically write the descriptor capture reads (0600), inside the store dir once it
    is checked, never through a link (UnsafeStoreDir if the dir is not safe)."""
    dir_fd = layout.open_store_dir(store_dir, create=True)
    try:
        data = {"reg_gen": reg_gen, "block_dim": block_dim, **desc}
        layout.write_file(dir_fd, registry_path(store_dir, rank).name, json.dumps(data).encode())
    finally:
        os.close(dir_fd)


def read_registry(store_dir: Path, rank: int) -> dict[str, Any] | None:
    """The descriptor as written; None if there is none, it cannot be read, or the store
    dir is not safe (a client writes into no other)."""
    try:
        return json.loads(layout.read_file(store_dir, registry_path(store_dir, rank).name))
    except (OSError, ValueError, StoreError):
        return None


def registration_owner(desc: dict[str, Any]) -> tuple[float, float] | None:
    """The pid and start time of the engine process that wrote ``desc`` (for
    ``shm.segment.process_gone``); None if it does not say."""
    owner = desc.get("owner_pid"), desc.get("owner_start")
    if all(isinstance(x, int | float) and not isinstance(x, bool) for x in owner):
        return owner  # type: ignore[return-value]
    return None


def ipc_ref_files(desc: dict[str, Any]) -> list[str]:
    """torch's reference-count files of a CUDA registration's tensors (each share's
    ``ref_counter_handle``; ``kvmem.describe`` stores it as hex): names of torch's own
    form only, nothing for a CPU registration."""
    if desc.get("kind") != "cuda":
        return []
    names = set()
    for tensor in desc.get("tensors", []):
        try:
            name = bytes.fromhex(tensor["share"][4]).decode().lstrip("/")
        except (KeyError, IndexError, TypeError, ValueError, UnicodeDecodeError):
            continue
        if _TORCH_REF_FILE.fullmatch(name):
            names.add(name)
    return sorted(names)


def unlink_ipc_files(ref_files: list[str], owner_pid: int) -> list[str]:
    """Unlink what CUDA IPC left in /dev/shm of a registration whose engine is gone:
    torch's ``ref_files`` (``ipc_ref_files``) and the driver's files of pid
    ``owner_pid``. Returns the names removed. torch unlinks its file only once every
    process that opened the tensors has let them go, and an engine goes first (capture
    and restore keep its KV open until they see it gone); the driver's stays after its
    process in every case seen. So each engine process that registered CUDA tensors
    left two files (80 KiB each) for good. The driver's are named by pid alone: they are
    left while any process has that pid, which may be a later one's. Only plain files
    of this user's are removed: never a link, never another user's."""
    names = list(ref_files)
    if owner_pid > 0 and not psutil.pid_exists(owner_pid):
        names += [p.name for p in SHM_DIR.glob(_DRIVER_IPC_FILE.format(pid=owner_pid))
                  if (m := _DRIVER_IPC_RE.fullmatch(p.name)) and int(m[1], 16) == owner_pid]
    removed = []
    for name in names:
        path = SHM_DIR / name
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(path)
                removed.append(name)
        except OSError:
            continue
    if removed:
        log.info("unlinked what CUDA IPC left of a gone engine: %s", removed)
    return removed
