"""Capture's background prefault: it faults every slot in (tmpfs pages allocated), reports
progress, changes no byte, falls back to reading on a kernel without
MADV_POPULATE_WRITE, and stops promptly."""

from __future__ import annotations

import os
import time

import pytest
from sparkcache.shm import SlotArena, segment_name
from sparkcache.workers import prefault
from sparkcache.workers.prefault import Prefaulter

MiB = 1024 * 1024


def _allocated(name: str) -> int:
    return os.stat("/dev/shm" + name).st_blocks * 512


@pytest.mark.parametrize("how", ["populate", "read"])
def test_prefault_allocates_every_slot_without_changing_a_byte(
    instance: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if how == "read":  # a kernel that refuses the advice (EINVAL)
        monkeypatch.setattr(prefault, "MADV_POPULATE_WRITE", 0x7FFF)
    name = segment_name(instance, 0, "arena")
    # Unallocated, as an arena the supervisor made before it allocated them: the pages
    # the prefault faults in are then the ones it allocates.
    with SlotArena.create(name, 3, 8 * MiB, reserve=False) as arena:
        arena.slot_array(1)[:5] = [1, 2, 3, 4, 5]  # bytes already written stay as they are
        assert _allocated(name) < MiB
        seen: list[int] = []
        pf = Prefaulter(arena, seen.append)
        assert pf.done.wait(30)
        pf.stop()
        assert seen[-1] == pf.total == 24 * MiB
        assert seen == sorted(seen)
        assert _allocated(name) >= 24 * MiB
        assert arena.slot_array(1)[:6].tolist() == [1, 2, 3, 4, 5, 0]


def test_prefault_stops_promptly(instance: str) -> None:
    name = segment_name(instance, 0, "arena")
    with SlotArena.create(name, 2, 512 * MiB, reserve=False) as arena:
        seen: list[int] = []
        pf = Prefaulter(arena, seen.append)
        t0 = time.monotonic()
        pf.stop()
        assert time.monotonic() - t0 < 5
        assert pf.done.is_set() and (not seen or seen[-1] < pf.total)
