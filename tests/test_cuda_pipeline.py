"""The capture path from CUDA KV tensors: the engine registers device tensors (CUDA IPC
handles keyed by device UUID), capture opens them once, gathers on the device and copies
each publication to its slot in one transfer; restores go back into fresh device tensors,
synchronously and through the restore worker. Skipped without a CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pipeline_util import check_restores, pipeline, sequences, wait_committed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_publish_and_restore_byte_exact(tmp_path: Path, instance: str) -> None:
    with pipeline(tmp_path / "store", instance, device="cuda") as engine:
        seqs = sequences(40, seed=3)
        for sid, tokens in seqs.items():
            assert engine.publish(sid, tokens), (sid, engine.client.counters)
        engine.drain()
        assert engine.client.counters.completed == 40, engine.client.counters
        assert engine.acknowledged == set(seqs)
        assert wait_committed(engine, settle=10) == {}
        assert check_restores(engine, seqs) == sum(len(engine.keys(t)) for t in seqs.values())
        # Through the restore worker (its own stream, page-locked staging) into fresh blocks.
        for t in engine.tensors:
            t.zero_()
        blocks, nxt = {}, 0
        for sid, tokens in seqs.items():
            blocks[sid] = list(range(nxt, nxt + len(engine.keys(tokens))))
            nxt += len(blocks[sid])
            assert engine.client.load(sid, tokens, blocks[sid]), engine.client.counters
        results = engine.wait_loaded(list(seqs))
        assert {r.status for r in results.values()} == {"ok"}, results
        for sid, tokens in seqs.items():
            assert all(engine.exact_pages(tokens, blocks[sid])), sid
        assert engine.max_call_s < 0.25, engine.max_call_s
