"""The free-space check of /dev/shm before a rank's segments are created."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from sparkcache import config, kvmem, segments
from sparkcache.config import GiB, MiB


class _Vfs:
    def __init__(self, free: int, blocks: int = 1 << 20) -> None:
        self.f_frsize, self.f_bavail, self.f_blocks = 4096, free // 4096, blocks


def _cfg(tmp_path: Path, **more: str) -> config.Config:
    return config.load(env={}, overrides={"store_dir": str(tmp_path), **more})


def _statvfs(monkeypatch: pytest.MonkeyPatch, vfs: _Vfs) -> list[str]:
    asked: list[str] = []
    monkeypatch.setattr(segments.os, "statvfs", lambda p: asked.append(str(p)) or vfs)
    return asked


def test_a_container_sized_dev_shm_is_refused_naming_what_is_needed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = _statvfs(monkeypatch, _Vfs(64 * MiB))  # docker's default --shm-size
    cfg = _cfg(tmp_path, ranks="2")  # default slots: 4 x 240 MiB per rank
    with pytest.raises(segments.ShmSpaceError) as e:
        segments.check_shm_space(cfg)
    assert asked == ["/dev/shm"]
    assert str(e.value) == (
        "/dev/shm has 64.0MiB free; rank segments need 1.9GiB (2 ranks x (4 slots x "
        "240.0MiB + 7.0MiB of rings and stats)); use fewer or smaller capture slots "
        "(SPARKCACHE_CAPTURE_SLOTS, SPARKCACHE_CAPTURE_SLOT_BYTES) or a larger /dev/shm "
        "(docker run --shm-size)"
    )


def test_enough_space_an_unlimited_tmpfs_and_restore_only_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _cfg(tmp_path, ranks="2")
    need = 2 * sum(segments.shm_needed(cfg).values())
    # The defaults keep a rank under 1 GiB of /dev/shm (slots bound the memory, not what
    # may be published: a larger publication goes in parts).
    assert 2 * 960 * MiB < need < 2 * GiB
    _statvfs(monkeypatch, _Vfs(need))
    segments.check_shm_space(cfg)
    _statvfs(monkeypatch, _Vfs(need - 4096))
    with pytest.raises(segments.ShmSpaceError):
        segments.check_shm_space(cfg)
    _statvfs(monkeypatch, _Vfs(0, blocks=0))  # tmpfs mounted with size=0: no limit
    segments.check_shm_space(cfg)
    # Without capture nobody touches the arena, and tmpfs allocates nothing for it.
    _statvfs(monkeypatch, _Vfs(64 * MiB))
    segments.check_shm_space(_cfg(tmp_path, ranks="2", access_mode="restore-only"))


def test_estimate_covers_what_create_makes(tmp_path: Path, instance: str) -> None:
    cfg = _cfg(tmp_path, instance=instance, capture_slots="3", capture_slot_bytes="1MiB")
    need = segments.shm_needed(cfg)
    rank = segments.RankSegments.create(cfg, 0, segments.STATS_SLOTS)
    try:
        used = {}
        for entry in os.scandir("/dev/shm"):
            if instance in entry.name:
                size = -(-entry.stat().st_size // 4096) * 4096
                kind = entry.name.rsplit(".", 1)[-1]
                kind = kind if kind in ("arena", "stats", "engine_stats", "note") else "rings"
                used[kind] = used.get(kind, 0) + size
    finally:
        rank.close()
    for kind in ("arena", "rings", "stats", "engine_stats", "note"):
        assert used[kind] <= need[kind] <= used[kind] + 8192, kind


def _allocated(path: str) -> bool:
    st = os.stat(path)
    return st.st_blocks * 512 >= st.st_size


def test_every_segment_is_allocated_when_made_the_arena_only_for_capture(
        tmp_path: Path, instance: str) -> None:
    """tmpfs allocates a page at its first touch: a /dev/shm that filled after the start's
    check would be found out by a SIGBUS in a worker or in vLLM. Allocated when made, it
    is found out at creation."""
    for mode, arena_allocated in (("read-write", True), ("restore-only", False)):
        cfg = _cfg(tmp_path, instance=instance, capture_slots="2", capture_slot_bytes="1MiB",
                   access_mode=mode)
        rank = segments.RankSegments.create(cfg, 0, segments.STATS_SLOTS)
        try:
            made = [e for e in os.scandir("/dev/shm")
                    if instance in e.name and not e.name.startswith("sem.")]
            kinds = {e.name.rsplit(".", 1)[-1] for e in made}
            assert {"arena", "stats", "engine_stats", "publish", "load"} <= kinds, kinds
            for entry in made:
                want = arena_allocated or not entry.name.endswith(".arena")
                assert _allocated(entry.path) == want, (mode, entry.name)
        finally:
            rank.close()
    # The engine's KV in shared memory (a staging pool, a synthetic engine) too.
    kv = kvmem.SharedKVCaches.create(instance, 0, [(64, 1024)], torch.float16)
    try:
        [entry] = [e for e in os.scandir("/dev/shm") if instance in e.name]
        assert _allocated(entry.path)
    finally:
        kv.close()


def test_a_dev_shm_that_fills_after_the_check_fails_creation_naming_it(
        tmp_path: Path, instance: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.posix_fallocate

    def full(fd: int, offset: int, length: int) -> None:
        if length > 6 * MiB:  # the arena (8 MiB), not a ring (3.4 MB at most) or stats
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", full)
    cfg = _cfg(tmp_path, instance=instance, capture_slots="4", capture_slot_bytes="2MiB")
    with pytest.raises(segments.ShmSpaceError) as e:
        segments.RankSegments.create(cfg, 0, segments.STATS_SLOTS)
    assert f"{instance}" in str(e.value) and "arena" in str(e.value), str(e.value)
    assert "docker run --shm-size" in str(e.value)
    assert not [name for name in os.listdir("/dev/shm") if instance in name]
