"""The capture path from CUDA KV tensors: the engine registers device tensors (CUDA IPC
handles keyed by device UUID), capture opens them once, gathers on the device and copies
each publication to its slot in one transfer; restores go back into fresh device tensors,
synchronously and through the restore worker. Skipped without a CUDA device."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from pipeline_util import (
    PAGE_TOKENS,
    SETTINGS,
    check_restores,
    pipeline,
    sequences,
    start_supervisor,
    stop_supervisor,
    wait_committed,
    wait_for,
)
from sparkcache.shm.segment import SHM_DIR

from sparkcache import registry

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


_ENGINE = """
import json, sys, torch
from sparkcache import config
from sparkcache.client import SparkCacheClient
client = SparkCacheClient(config.load(env={}, overrides=json.loads(sys.argv[1])), 0,
                          model_id="ipc-refs")
kv = [torch.zeros((2, 8, int(sys.argv[2]), 2, 8), dtype=torch.float16, device="cuda")
      for _ in range(2)]
assert client.register_kv_caches(kv, 1)
print("registered", flush=True)
sys.stdin.readline()
"""


def test_what_cuda_ipc_left_of_a_gone_engine_is_unlinked(
        tmp_path: Path, instance: str) -> None:
    """torch keeps the reference counts of an engine's shared KV tensors in a file of
    /dev/shm that it unlinks only once every process that opened them let go, and the
    CUDA driver leaves a file of the engine's pid: the engine goes first, so each one
    left both. The restore worker, which opens a live engine's registration while idle,
    unlinks them once the engine is gone."""
    store = tmp_path / "store"
    sup = start_supervisor(store, instance)
    engine = None
    try:
        settings = {"store_dir": str(store), "instance": instance, **SETTINGS}
        engine = subprocess.Popen([sys.executable, "-c", _ENGINE, json.dumps(settings),
                                   str(PAGE_TOKENS)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert engine.stdout.readline().strip() == "registered"
        desc = registry.read_registry(store, 0)
        files = registry.ipc_ref_files(desc)
        shares = [t["share"] for t in desc["tensors"]]
        assert files and all((SHM_DIR / f).exists() for f in files), shares
        time.sleep(3)  # the restore worker's idle checks open the live engine's tensors
        engine.stdin.close()
        assert engine.wait(30) == 0
        driver = f"cuda.shm.*.{engine.pid:x}.*"
        wait_for(lambda: not any((SHM_DIR / f).exists() for f in files)
                 and not list(SHM_DIR.glob(driver)), 20,
                 f"the restore worker to unlink {files} and {driver}")
    finally:
        if engine is not None and engine.poll() is None:
            engine.kill()
            engine.wait()
        stop_supervisor(sup)
