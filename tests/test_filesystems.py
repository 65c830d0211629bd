"""A store dir on a network filesystem is refused, by the config and by the store itself,
before anything is created there; one in memory is allowed."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from sparkcache.config import ConfigError, load
from sparkcache.filesystems import filesystem_of
from sparkcache.store import PageStore, UnsafeStoreDir


def mounted(monkeypatch: pytest.MonkeyPatch, *mounts: tuple[str, str]) -> None:
    """The mount table as ``psutil`` reads it: ``(mount point, type)`` in listed order."""
    table = [SimpleNamespace(mountpoint=point, fstype=fstype) for point, fstype in mounts]
    monkeypatch.setattr(psutil, "disk_partitions", lambda all=False: table)


def test_the_longest_mount_point_holding_the_path_names_its_filesystem(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    share = tmp_path / "my share"
    mounted(monkeypatch, ("/", "ext4"), (str(tmp_path), "xfs"), (str(share), "tmpfs"),
            (str(share), "nfs4"),  # mounted over it: the last listed is the one on top
            (str(tmp_path / "my"), "cifs"))  # a prefix of the name, not of the path
    assert filesystem_of(share / "store") == "nfs4"  # not made yet: where it would be
    assert filesystem_of(tmp_path / "other") == "xfs"
    assert filesystem_of(Path("/")) == "ext4"


def test_a_store_dir_on_a_network_filesystem_is_refused_and_nothing_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mounted(monkeypatch, ("/", "ext4"), (str(tmp_path), "nfs4"))
    store = tmp_path / "store"
    with pytest.raises(ConfigError) as err:
        load({"SPARKCACHE_STORE_DIR": str(store)})
    assert str(err.value) == (
        f"SPARKCACHE_STORE_DIR (--store-dir)='{store}' is invalid: expected a directory on "
        f"a local filesystem such as ext4 or xfs ({tmp_path} is on nfs4, a network "
        f"filesystem: the store's SQLite index and its locks do not work there)")
    with pytest.raises(UnsafeStoreDir, match="on nfs4, a network filesystem"):
        PageStore(store, 0)
    assert not store.exists()


def test_a_store_dir_in_memory_or_on_a_local_disk_is_taken(tmp_path: Path) -> None:
    assert load({"SPARKCACHE_STORE_DIR": str(tmp_path / "store")}).store_dir == tmp_path / "store"
    if Path("/dev/shm").is_dir():
        assert filesystem_of(Path("/dev/shm")) == "tmpfs"
    with PageStore(tmp_path / "store", 0) as st:
        assert st.usage().used_bytes == 0
