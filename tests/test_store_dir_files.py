"""The store dir's own files (runtime.json, kv-r<r>.json): written only inside a checked
store dir, through a fresh temporary name, never through a planted link; read without
following one."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from sparkcache import kvmem, runtime
from sparkcache.store import UnsafeStoreDir


@pytest.fixture
def store(tmp_path: Path) -> Path:
    d = tmp_path / "store"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    v = tmp_path / "victim"
    v.write_text("precious")
    return v


def _plain(path: Path) -> os.stat_result:
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    return st


def test_runtime_write_never_follows_a_planted_link(store: Path, victim: Path) -> None:
    # The old temporary name, and the file itself, planted as links to another file.
    (store / "runtime.tmp").symlink_to(victim)
    (store / "runtime.json").symlink_to(victim)
    assert runtime.read(store) is None  # a link is not read either
    runtime.write(store, {"pid": 1})
    assert victim.read_text() == "precious"
    _plain(store / "runtime.json")
    assert runtime.read(store) == {"pid": 1}
    # Nothing but the file and the planted link are left behind.
    assert sorted(p.name for p in store.iterdir()) == ["runtime.json", "runtime.tmp"]


def test_registry_write_never_follows_a_planted_link(store: Path, victim: Path) -> None:
    (store / f"kv-r0.{os.getpid()}.tmp").symlink_to(victim)
    kvmem.write_registry(store, 0, 7, 1, {"tensors": []})
    assert victim.read_text() == "precious"
    _plain(store / "kv-r0.json")
    assert kvmem.read_registry(store, 0) == {"reg_gen": 7, "block_dim": 1, "tensors": []}


def test_registry_creates_the_store_dir_0700(tmp_path: Path) -> None:
    store = tmp_path / "a" / "store"
    kvmem.write_registry(store, 1, 3, 1, {})
    assert stat.S_IMODE(os.stat(store).st_mode) == 0o700
    assert json.loads((store / "kv-r1.json").read_text())["reg_gen"] == 3


@pytest.mark.parametrize("kind", ["symlink", "mode", "owner"])
def test_files_are_written_only_into_a_safe_store_dir(
    tmp_path: Path, kind: str
) -> None:
    real, store = tmp_path / "real", tmp_path / "store"
    real.mkdir(mode=0o700)
    if kind == "symlink":
        store.symlink_to(real)
    else:
        store.mkdir(mode=0o700)
        if kind == "mode":
            store.chmod(0o777)
        else:
            os.chown(store, 65534, -1)
    with pytest.raises(UnsafeStoreDir, match=f"store dir {store} "):
        runtime.write(store, {"pid": 1})
    with pytest.raises(UnsafeStoreDir, match=f"store dir {store} "):
        kvmem.write_registry(store, 0, 7, 1, {})
    assert list(real.iterdir()) == []
    assert sorted(p.name for p in store.iterdir()) == []


@pytest.mark.parametrize("kind", ["symlink", "mode", "owner"])
def test_files_are_read_only_from_a_safe_store_dir(tmp_path: Path, kind: str) -> None:
    """What a supervisor or a client writes is read back only from a dir they would have
    written into: in one others can write (or reached through a link) it may be planted."""
    real, store = tmp_path / "real", tmp_path / "store"
    real.mkdir(mode=0o700)
    runtime.write(real, {"pid": 1})
    kvmem.write_registry(real, 0, 7, 1, {})
    assert runtime.read(real) == {"pid": 1} and kvmem.read_registry(real, 0) is not None
    if kind == "symlink":
        store.symlink_to(real)
    else:
        real.rename(store)
        if kind == "mode":
            store.chmod(0o777)
        else:
            os.chown(store, 65534, -1)
    assert runtime.read(store) is None
    assert kvmem.read_registry(store, 0) is None
