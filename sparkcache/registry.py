"""``kv-r<r>.json``: the descriptor of the KV tensors an engine rank registered
(``sparkcache.kvmem.describe``, plus its registration generation and block dimension),
written by the client and read by the workers that open the tensors. Apart from kvmem so
that a reader need not import torch to learn whether, and what, is registered.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sparkcache.store import StoreError, layout


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
    ``protocol.process_gone``); None if it does not say."""
    owner = desc.get("owner_pid"), desc.get("owner_start")
    if all(isinstance(x, int | float) and not isinstance(x, bool) for x in owner):
        return owner  # type: ignore[return-value]
    return None
