"""The soak removes a finished lane's store in the background (soak/remover.py)."""

from __future__ import annotations

import threading

from sparkcache.soak.remover import StoreRemover


def _store(path, files: int):
    path.mkdir()
    for i in range(files):
        (path / f"{i:04x}").write_bytes(b"x" * 64)
    return path


def test_removals_run_one_after_another_and_wait_ends_them(tmp_path):
    remover = StoreRemover()
    first, second = _store(tmp_path / "a", 200), _store(tmp_path / "b", 200)
    remover.remove(first)
    remover.remove(second)  # waits for the first
    assert not first.exists()
    remover.wait()
    assert not second.exists()
    assert not [t for t in threading.enumerate() if t.name == "soak-store-remover"]


def test_a_missing_store_is_no_error(tmp_path):
    remover = StoreRemover()
    remover.remove(tmp_path / "never-made")
    remover.wait()
    remover.wait()  # nothing running: returns at once
