"""``SharedKVCaches.adopt``: an engine's private CPU KV cache moved into a segment in place,
as the vLLM worker side does with vLLM's CPU backend."""

from __future__ import annotations

import errno
import os
import stat

import pytest
import torch
from sparkcache.shm.segment import SHM_DIR, instance_entries

from sparkcache import kvmem


def _vllm_like(blocks: int = 8) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A raw buffer and the per-layer views vLLM registers over it (a dtype view, a
    reshape, a permute): the raw tensor is not among them."""
    raw = torch.arange(2 * blocks * 4 * 16 * 8, dtype=torch.float32)
    layers = [raw.view(2, blocks, 16, 4, 8)[i].permute(0, 2, 1, 3) for i in range(2)]
    return raw, layers


def test_every_view_reads_and_writes_the_segment(instance: str) -> None:
    raw, layers = _vllm_like()
    want = raw.clone()
    shared = kvmem.SharedKVCaches.adopt(instance, 0, layers)
    try:
        (name,) = instance_entries(instance)
        assert stat.S_IMODE(os.stat(SHM_DIR / name).st_mode) == 0o600
        assert torch.equal(raw, want), "the bytes moved with the memory"
        # A write through a tensor that was not passed in (vLLM's raw buffer) is seen by
        # another mapping of the segment: the storage itself moved.
        raw[5] = -1.0
        opened = kvmem.open_tensors(kvmem.describe(layers))
        try:
            assert opened.tensors[0].flatten()[0] == layers[0].flatten()[0]
            assert opened.tensors[0].permute(0, 2, 1, 3).flatten()[5] == -1.0
            opened.tensors[1][1, 2, 3, 4] = 7.0  # and the other way round
            assert layers[1][1, 2, 3, 4] == 7.0
        finally:
            opened.close()
    finally:
        shared.close()
    assert instance_entries(instance) == []
    # The name is gone; the engine's tensors keep their mapping as long as they live.
    layers[0][0, 0, 0, 0] = 3.0
    assert raw[0] == 3.0


def test_a_dev_shm_too_small_leaves_the_tensors_as_they_were(
        instance: str, monkeypatch: pytest.MonkeyPatch) -> None:
    raw, layers = _vllm_like()
    before = raw.untyped_storage().data_ptr()

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError):
        kvmem.SharedKVCaches.adopt(instance, 0, layers)
    assert raw.untyped_storage().data_ptr() == before
    assert instance_entries(instance) == []
    with pytest.raises(ValueError, match="SharedKVCaches"):
        kvmem.describe(layers)


def test_an_exit_midway_leaves_no_segment_and_every_tensor_readable(
        instance: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGTERM's SystemExit between two storages' swaps: the name is gone at once, and
    the storage already moved still reads its bytes through the mapping it keeps."""
    first, second = torch.arange(256, dtype=torch.float32), torch.arange(512.0, 768.0)
    want = [first.clone(), second.clone()]
    real_swap = torch.UntypedStorage._swap_data_ptr_
    swapped = []

    def swap_then_exit(storage: torch.UntypedStorage, other: torch.UntypedStorage) -> None:
        if swapped:
            raise SystemExit(143)
        real_swap(storage, other)
        swapped.append(storage)

    monkeypatch.setattr(torch.UntypedStorage, "_swap_data_ptr_", swap_then_exit,
                        raising=False)
    with pytest.raises(SystemExit):
        kvmem.SharedKVCaches.adopt(instance, 0, [first, second])
    assert instance_entries(instance) == []
    assert torch.equal(first, want[0]) and torch.equal(second, want[1])
    first[3] = -1.0
    assert first[3] == -1.0
