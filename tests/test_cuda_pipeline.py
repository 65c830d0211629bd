"""The capture path from CUDA KV tensors: the engine registers device tensors (CUDA IPC
handles keyed by device UUID), capture opens them once, gathers on the device and copies
each publication to its slot in one transfer; restores go back into fresh device tensors.
Skipped without a CUDA device."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from pipeline_util import make_cfg, sequences, start_supervisor, stop_supervisor

from shm.segment import instance_entries
from sparkcache.store.fsck import fsck
from sparkcache.synthetic import SyntheticEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_publish_and_restore_byte_exact(tmp_path: Path, instance: str) -> None:
    store = tmp_path / "store"
    sup = start_supervisor(store, instance)
    engine = None
    try:
        engine = SyntheticEngine.create(make_cfg(store, instance), 0, device="cuda")
        assert engine.client._reg is not None
        seqs = sequences(40, seed=3)
        for sid, tokens in seqs.items():
            assert engine.publish(sid, tokens), (sid, engine.client.counters)
        engine.drain()
        assert engine.client.counters.completed == 40, engine.client.counters
        assert engine.acknowledged == set(seqs)
        deadline = time.monotonic() + 60
        while any(engine.client.lookup(t) < len(t) for t in seqs.values()):
            assert time.monotonic() < deadline, "commit did not catch up"
            time.sleep(0.1)
        for sid, tokens in seqs.items():
            restored, exact = engine.restore_exact(tokens)
            assert restored == exact == len(engine.keys(tokens)), sid
        assert engine.max_call_s < 0.25, engine.max_call_s
    finally:
        if engine is not None:
            engine.close()
        rc, err = stop_supervisor(sup)
    assert rc == 0, err[-3000:]
    assert fsck(store).ok
    assert instance_entries(instance) == []
