"""The client never raises and never blocks: with no supervisor, in each access mode, with
bad input, every publication is skipped and counted by reason."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from pipeline_util import (
    BLOCKS,
    LAYERS,
    PAGE_TOKENS,
    SHAPE,
    SyntheticEngine,
    make_cfg,
    pipeline,
    sequences,
    start_supervisor,
    stop_supervisor,
    wait_committed,
    wait_for,
)
from sparkcache.shm import Ring
from sparkcache.shm.layouts import FREED, PUBLISH
from sparkcache.workers.lifecycle import FAULT_FILE_ENV, FAULT_ROLE_ENV, Role

from sparkcache import segments
from sparkcache.client import SparkCacheClient
from sparkcache.filesystems import MEMORY_FILESYSTEMS
from sparkcache.identity import KeyExtras
from sparkcache.kvmem import SharedKVCaches
from sparkcache.protocol import release_seconds
from sparkcache.store.reader import StoreReader
from sparkcache.synthetic import MODEL_ID


@pytest.fixture
def kv(instance: str):
    caches = SharedKVCaches.create(instance, 0, [SHAPE] * LAYERS, torch.float16)
    yield caches
    caches.close()


def _client(tmp_path: Path, instance: str, kv: SharedKVCaches, **more: str) -> SparkCacheClient:
    c = SparkCacheClient(make_cfg(tmp_path / "store", instance, **more), 0, model_id="m")
    assert c.register_kv_caches(kv.tensors)
    return c


def test_no_supervisor_skips_counted_and_fast(tmp_path: Path, instance: str, kv) -> None:
    c = _client(tmp_path, instance, kv)
    t0 = time.perf_counter()
    for i in range(100):
        assert c.publish(i, list(range(40)), [0, 1, 2]) is False
    assert time.perf_counter() - t0 < 0.5
    assert c.counters.skipped["supervisor_absent"] == 100
    assert c.lookup(list(range(40))) == 0  # no store yet: a miss, not an error raised
    assert c.restore(list(range(40)), [0, 1, 2]) == 0
    assert c.poll_completions() == []
    t0 = time.perf_counter()
    for i in range(100):
        assert c.load(i, list(range(40)), [0, 1, 2]) is False
    assert time.perf_counter() - t0 < 0.5
    assert c.counters.misses["supervisor_absent"] == 100
    assert c.poll_loads() == [] and c.loads_in_flight == 0
    errors = c.counters.misses["error"]  # the lookup and restore above: no store yet
    assert c.load("x", list(range(40)), [0, 1, 2], extra="bad") is False  # type: ignore
    assert c.counters.misses["error"] == errors + 1
    c.close()


@pytest.mark.parametrize("mode,reason", [("off", "mode_off"), ("restore-only", "restore_only")])
def test_access_modes(tmp_path: Path, instance: str, kv, mode: str, reason: str) -> None:
    c = _client(tmp_path, instance, kv, access_mode=mode)
    assert c.publish("s", list(range(20)), [0, 1]) is False
    assert c.counters.skipped[reason] == 1
    c.close()


def test_unregistered_and_bad_registration(tmp_path: Path, instance: str) -> None:
    c = SparkCacheClient(make_cfg(tmp_path / "store", instance), 0, model_id="m")
    assert c.publish("s", [1, 2, 3], [0]) is False
    assert c.counters.skipped["unregistered"] == 1
    assert c.register_kv_caches([torch.zeros(2, 4, 16, 1, 8)]) is False  # not shared memory
    assert c.register_kv_caches([torch.zeros(2, 4, 8, 1, 8)]) is False  # wrong block size
    assert c.counters.skipped["register_failed"] == 2


def test_the_kv_format_is_in_the_namespace(tmp_path: Path, instance: str) -> None:
    """vLLM keeps every fp8 / fp4 KV format in uint8 tensors: a format named at
    registration is the namespace's dtype, so engines of two formats on one store never
    share a page's key; unnamed, the storage dtype is, as before (an unquantized cache
    keeps the pages stored under it)."""
    caches = SharedKVCaches.create(instance, 0, [SHAPE] * LAYERS, torch.uint8)
    try:
        keys = {}
        for fmt in (None, "fp8_e4m3", "fp8_e5m2"):
            c = SparkCacheClient(make_cfg(tmp_path / "store", instance), 0, model_id="m")
            assert c.register_kv_caches(caches.tensors, kv_dtype=fmt)
            assert c._reg.namespace.dtype == (fmt or "torch.uint8")
            keys[fmt] = tuple(c._keys(list(range(40))))
            c.close()
        assert len(set(keys.values())) == 3
    finally:
        caches.close()


def test_restore_refuses_block_ids_out_of_range(tmp_path: Path, instance: str, kv) -> None:
    c = _client(tmp_path, instance, kv)
    assert c.restore(list(range(20)), [0, 10**6]) == 0
    assert c.counters.misses["bad_block"] == 1
    assert c.load("a", list(range(20)), [0, 10**6]) is False
    assert c.load("b", list(range(20)), [-1, 0]) is False
    assert c.counters.misses["bad_block"] == 3
    assert c.load("c", [], [0]) is False and c.load("d", list(range(20)), []) is False
    assert c.load("e", list(range(20)), [0, 1], max_pages=0) is False
    assert c.counters.misses["empty_load"] == 3
    c.close()


def test_load_in_mode_off_and_unregistered(tmp_path: Path, instance: str, kv) -> None:
    c = _client(tmp_path, instance, kv, access_mode="off")
    assert c.load("a", list(range(20)), [0, 1]) is False
    assert c.counters.misses["mode_off"] == 1
    u = SparkCacheClient(make_cfg(tmp_path / "store", instance), 0, model_id="m")
    assert u.load("a", list(range(20)), [0, 1]) is False
    assert u.counters.misses["unregistered"] == 1
    c.close()
    u.close()


def test_model_id_is_required(tmp_path: Path, instance: str) -> None:
    cfg = make_cfg(tmp_path / "store", instance)
    with pytest.raises(TypeError, match="model_id"):
        SparkCacheClient(cfg, 0)  # type: ignore[call-arg]
    for bad in ("", " ", None):
        with pytest.raises(ValueError, match="give the model's identity"):
            SparkCacheClient(cfg, 0, model_id=bad)  # type: ignore[arg-type]


def test_pages_survive_a_restart_with_another_block_count(tmp_path: Path, instance: str) -> None:
    """vLLM sizes its KV blocks by profiling at every start: the same model registered
    again with more or fewer blocks finds (and restores) what it stored; the same tokens
    with another salt or adapter find nothing, and a salted request finds only its own."""
    store = tmp_path / "store"
    seqs = sequences(6, PAGE_TOKENS, seed=3)
    salted = list(range(7, 7 + 3 * PAGE_TOKENS + 5))  # published with a salt only
    tenant = KeyExtras(cache_salt="tenant-a")
    with pipeline(store, instance) as engine:
        for sid, tokens in seqs.items():
            assert engine.publish(sid, tokens)
        assert engine.publish("salted", salted, extra=tenant)
        engine.drain()
        assert engine.acknowledged == {*seqs, "salted"}
        assert wait_committed(engine, seqs=seqs) == {}
        deadline = time.monotonic() + 60
        while engine.client.lookup(salted, extra=tenant) < len(salted):
            assert time.monotonic() < deadline, "the salted publication never committed"
            time.sleep(0.1)
    cfg = make_cfg(store, instance)
    for blocks in (BLOCKS // 2, BLOCKS * 3):  # the store stays; its supervisor is gone
        engine = SyntheticEngine.create(cfg, blocks=blocks, model_id=MODEL_ID)
        try:
            assert engine.client._reg.views.num_blocks == blocks
            for sid, tokens in seqs.items():
                assert engine.client.lookup(tokens) == len(tokens), (blocks, sid)
                restored, exact = engine.restore_exact(tokens)
                assert restored == exact == len(engine.keys(tokens)), (blocks, sid)
                for other in (KeyExtras(cache_salt="tenant-b"), KeyExtras(adapter="lora-1"),
                              KeyExtras(mm_hashes=("img-0",))):
                    assert engine.client.lookup(tokens, extra=other) == 0, (sid, other)
                    assert engine.client.restore(tokens, [0, 1], extra=other) == 0
            assert engine.client.lookup(salted, extra=tenant) == len(salted)
            assert engine.restore_exact(salted, extra=tenant) == (4, 4)
            # Neither the plain request nor another kind of extra with the same text hits.
            assert engine.client.lookup(salted) == 0
            assert engine.client.lookup(salted, extra=KeyExtras(adapter="tenant-a")) == 0
        finally:
            engine.close()
    other_model = SyntheticEngine.create(cfg, model_id="another-model")
    try:
        assert all(other_model.client.lookup(t) == 0 for t in seqs.values())
    finally:
        other_model.close()


def test_the_first_load_and_publication_after_a_supervisor_is_replaced_are_served(
        tmp_path: Path, instance: str, kv) -> None:
    """A supervisor stopped and another started between two calls (an upgrade, a restart
    under a running engine): the client attaches to the new one's segments at once, so
    its first load is restored and its first publication captured. Until 2026-12-04 the
    first of each after a restart was refused (``restore_down``, ``capture_down``) and
    the engine recomputed, or did not save, that turn."""
    store = tmp_path / "store"
    c = _client(tmp_path, instance, kv)
    first = list(range(4 * PAGE_TOKENS))
    second = list(range(1000, 1000 + 4 * PAGE_TOKENS))
    try:
        sup = start_supervisor(store, instance)
        try:
            assert c.publish("first", first, [0, 1, 2, 3])
            wait_for(lambda: [d for d in c.poll_durable() if d.durable], 60,
                     "the publication to be durable", poll=0.02)
        finally:
            stop_supervisor(sup)
        sup = start_supervisor(store, instance)
        try:
            assert c.load("again", first, [8, 9, 10, 11])  # the first call after it
            results = wait_for(c.poll_loads, 60, "the load", poll=0.02)
            assert [(r.load_id, r.status, r.tokens) for r in results] == [
                ("again", "ok", len(first))]
        finally:
            stop_supervisor(sup)
        sup = start_supervisor(store, instance)
        try:
            assert c.publish("second", second, [4, 5, 6, 7])  # the first call after it
            wait_for(c.poll_completions, 60, "the publication to be captured", poll=0.02)
        finally:
            stop_supervisor(sup)
        assert not c.counters.skipped and not c.counters.misses, c.counters
    finally:
        c.close()


def test_a_store_dir_or_instance_not_the_supervisors_is_named_and_counted(
        tmp_path: Path, instance: str, kv, caplog: pytest.LogCaptureFixture) -> None:
    """An engine whose store dir and instance name two supervisors (or a supervisor and
    no store) is not attached: it says so once, naming what the running supervisor
    serves and the remedy, and counts its publications and loads under that reason.
    Before, it published to the instance's workers while registering in another store:
    every save was rejected there as unregistered, and nothing said why."""
    store = tmp_path / "store"
    sup = start_supervisor(store, instance)
    clients = []
    try:
        with caplog.at_level(logging.INFO, logger="sparkcache.client"):
            right = _client(tmp_path, instance, kv)
            clients.append(right)
            elsewhere = SparkCacheClient(make_cfg(tmp_path / "elsewhere", instance), 0,
                                         model_id="m")
            clients.append(elsewhere)
            assert elsewhere.register_kv_caches(kv.tensors)
            for i in range(3):
                assert elsewhere.publish(i, list(range(40)), [0, 1, 2]) is False
            assert elsewhere.load("x", list(range(40)), [0, 1, 2]) is False
            other = SparkCacheClient(make_cfg(store, "someone-else"), 0, model_id="m")
            clients.append(other)
            assert other.register_kv_caches(kv.tensors)
            assert other.publish("y", list(range(40)), [0, 1, 2]) is False
        lines = [r.getMessage() for r in caplog.records if r.name == "sparkcache.client"]
        attached = [m for m in lines if "attached to" in m]
        assert len(attached) == 1, lines
        assert f"pid {sup.pid}" in attached[0] and str(store.resolve()) in attached[0]
        assert f"pages of {PAGE_TOKENS} tokens" in attached[0], attached
        mismatch = [m for m in lines if "not attached" in m and "elsewhere" in m]
        assert len(mismatch) == 1, lines  # said once, not per publication
        assert f"store {store.resolve()}" in mismatch[0], mismatch
        assert f"store_dir {str(store.resolve())!r}" in mismatch[0], mismatch
        assert elsewhere.counters.skipped == {"store_mismatch": 3}
        assert elsewhere.counters.misses["store_mismatch"] == 1
        assert other.counters.skipped == {"instance_mismatch": 1}
        named = [m for m in lines if "someone-else" in m]
        assert named and f"instance {instance!r}" in named[0], lines
        # The right one is served.
        assert right.register_kv_caches(kv.tensors)  # the registry the others overwrote
        assert right.publish("z", list(range(4 * PAGE_TOKENS)), [0, 1, 2, 3])
        assert not right.counters.skipped
    finally:
        for c in clients:
            c.close()
        stop_supervisor(sup)


def test_a_page_larger_than_the_supervisors_capture_slots_is_named_and_not_saved(
        tmp_path: Path, instance: str, kv, caplog: pytest.LogCaptureFixture) -> None:
    """The supervisor's capture slots hold less than one of the engine's pages: each save
    would be refused by capture, so the rank says why once and skips them as
    ``page_too_large``; loads are still served."""
    store = tmp_path / "store"
    sup = start_supervisor(store, instance, "--capture-slot-bytes", "8KiB")
    c = _client(tmp_path, instance, kv)
    try:
        with caplog.at_level(logging.WARNING, logger="sparkcache.client"):
            for i in range(3):
                assert c.publish(i, list(range(4 * PAGE_TOKENS)), [0, 1, 2, 3]) is False
        assert c.counters.skipped == {"page_too_large": 3}
        named = [r.getMessage() for r in caplog.records if "capture slots" in r.getMessage()]
        assert len(named) == 1 and "(8192 bytes)" in named[0], named
        assert c.load("l", list(range(4 * PAGE_TOKENS)), [4, 5, 6, 7])  # not refused
        wait_for(c.poll_loads, 60, "the load's report", poll=0.02)
    finally:
        c.close()
        stop_supervisor(sup)


def test_a_worker_down_under_its_supervisor_keeps_the_connection(
        tmp_path: Path, instance: str, kv) -> None:
    """Capture crash-looping under a running supervisor: publications meanwhile are
    refused as ``capture_down`` (not ``supervisor_absent``: the supervisor is there), the
    client keeps its connection (it does not open every segment again while the worker
    is away), and once capture starts again a publication is taken."""
    store, fault = tmp_path / "store", tmp_path / "crash"
    c = _client(tmp_path, instance, kv)
    tokens = list(range(4 * PAGE_TOKENS))
    n = iter(range(10**6))

    def publish(blocks: list[int]) -> bool:
        c.poll_completions()  # blocks back: no refusal is for publications pending
        return c.publish(f"s{next(n)}", tokens, blocks)

    # A killed capture restarted at once is never seen down (its slot stays READY for
    # the 0.3 s it takes): one that dies as it starts, with the supervisor retrying, is.
    sup = start_supervisor(store, instance, "--startsecs", "1", "--startretries", "100",
                           env={FAULT_ROLE_ENV: "capture", FAULT_FILE_ENV: str(fault)})
    try:
        assert publish([0, 1, 2, 3])
        conn = c._conn
        fault.touch()
        time.sleep(1.5)  # past --startsecs: a crash of a running worker, then failed starts
        os.kill(conn.stats.read(int(Role.CAPTURE)).pid, signal.SIGKILL)
        wait_for(lambda: not publish([4, 5, 6, 7]) and c.counters.skipped["capture_down"],
                 30, "a refusal while capture is down", poll=0.05)
        assert c._conn is conn
        fault.unlink()
        wait_for(lambda: publish([8, 9, 10, 11]), 60, "a publication taken again", poll=0.1)
        assert c._conn is conn
        assert not c.counters.skipped["supervisor_absent"], c.counters
    finally:
        c.close()
        stop_supervisor(sup)


@pytest.mark.gpu
def test_cuda_descriptor_round_trip() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from sparkcache import kvmem

    t = torch.arange(2 * 4 * 16 * 8, dtype=torch.float16, device="cuda").view(2, 4, 16, 1, 8)
    desc = kvmem.describe([t])
    assert desc["kind"] == "cuda" and desc["tensors"][0]["device_uuid"]


def _page(tensors: list[torch.Tensor], block: int, block_dim: int = 1) -> bytes:
    return b"".join(t.select(block_dim, block).contiguous().view(-1).view(torch.uint8)
                    .numpy().tobytes() for t in tensors)


def test_block_views_fast_and_strided_paths_agree(instance: str) -> None:
    from sparkcache.kvmem import BlockViews

    kv = SharedKVCaches.create(instance, 0, [(2, 6, 16, 2, 8)] * 2, torch.float16)
    try:
        for t in kv.tensors:
            t.normal_()
        strided = [t.transpose(3, 4) for t in kv.tensors]  # not contiguous: torch path
        fast, slow = BlockViews(kv.tensors, 1), BlockViews(strided, 1)
        assert fast.run_bytes == [16 * 2 * 8 * 2] * 4 and slow.run_bytes == [2 * 16 * 2 * 8 * 2] * 2
        a = np.empty(fast.page_bytes, np.uint8)
        b = np.empty(slow.page_bytes, np.uint8)
        fast.gather(4, a)
        slow.gather(4, b)
        assert a.tobytes() == _page(kv.tensors, 4)
        assert b.tobytes() == _page(strided, 4)
        fast.scatter(0, a)
        assert all(torch.equal(t[:, 0], t[:, 4]) for t in kv.tensors)
        slow.scatter(1, b)
        assert all(torch.equal(t[:, 1], t[:, 4]) for t in kv.tensors)
    finally:
        kv.close()


def _run_major(views, tensors: list[torch.Tensor], blocks: list[int]) -> bytes:
    """What ``gather_runs`` must produce, built from whole pages: run r of every block."""
    pages = [np.frombuffer(_page(tensors, b, views.block_dim), np.uint8) for b in blocks]
    out, at = [], 0
    for size in views.run_bytes:
        out += [p[at : at + size].tobytes() for p in pages]
        at += size
    return b"".join(out)


# How the layer tensors of the block-view tests are made, by path: contiguous
# [K/V, blocks, ...]; the same transposed (not contiguous); vLLM 0.33's view over LBNHC
# memory ([blocks, heads, block size, K+V] over [blocks, block size, heads, K+V]). Each
# also through the device path (staging buffer, one transfer and one index_select or
# index_copy_ per tensor), run here on CPU tensors; and that view of an fp8 KV cache,
# which has no index_copy_ of its own.
VIEW_PATHS = ["host", "strided", "lbnhc", "device", "strided-device", "lbnhc-device",
              "lbnhc-fp8-device"]


@contextlib.contextmanager
def _block_views(instance: str, path: str):
    from sparkcache.kvmem import BlockViews

    shape = (9, 16, 2, 16) if path.startswith("lbnhc") else (2, 9, 16, 2, 8)
    dtype = torch.float8_e4m3fn if "fp8" in path else torch.float16
    kv = SharedKVCaches.create(instance, 0, [shape, shape], dtype)
    try:
        for t in kv.tensors:  # random bytes (fp8 has no normal_)
            raw = t.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
        block_dim = 0 if path.startswith("lbnhc") else 1
        tensors = ([t.transpose(3, 4) for t in kv.tensors] if path.startswith("strided")
                   else [t.permute(0, 2, 1, 3) for t in kv.tensors] if block_dim == 0
                   else kv.tensors)
        assert all(t.is_contiguous() for t in tensors) == (path in ("host", "device"))
        views = BlockViews(tensors, block_dim)
        views._device = path.endswith("device")
        yield views, tensors
    finally:
        kv.close()


@pytest.mark.parametrize("path", VIEW_PATHS)
def test_gather_runs_is_run_major(instance: str, path: str) -> None:
    """Every path lays out many blocks the same way."""
    with _block_views(instance, path) as (views, tensors):
        blocks = [7, 0, 3, 3, 8]
        out = np.zeros(views.page_bytes * len(blocks), np.uint8)
        views.gather_runs(blocks, out)
        assert out.tobytes() == _run_major(views, tensors, blocks)
        with pytest.raises(ValueError, match="expected"):
            views.gather_runs(blocks, out[:-1])


@pytest.mark.parametrize("path", VIEW_PATHS)
def test_scatter_pages_is_the_inverse_of_gather(instance: str, path: str) -> None:
    """Pages as the store holds them (each page's runs in order) land in their blocks the
    same way on every path."""
    with _block_views(instance, path) as (views, tensors):
        dim = views.block_dim
        sources, targets = [7, 0, 3, 8], [1, 2, 5, 6]
        pages = np.stack([np.frombuffer(_page(tensors, b, dim), np.uint8) for b in sources])
        before = [t.clone() for t in tensors]
        views.scatter_pages(targets, pages)
        for t, old in zip(tensors, before, strict=True):
            # Compared as integers: random bytes make NaNs, and fp8 has no torch.equal.
            as_int = {1: torch.uint8, 2: torch.int16}[t.element_size()]
            t, old = t.view(as_int), old.view(as_int)
            for s, d in zip(sources, targets, strict=True):
                assert torch.equal(t.select(dim, d), t.select(dim, s))
            for b in (0, 3, 4, 7, 8):  # nothing else written
                assert torch.equal(t.select(dim, b), old.select(dim, b))
        with pytest.raises(ValueError, match="expected"):
            views.scatter_pages(targets, pages[:, :-1].copy())


def test_ring_faults_are_skips_and_misses_never_exceptions(tmp_path: Path, instance: str) -> None:
    """The supervisor goes away under a connected client (its rings closed and unlinked),
    then a segment of another layout takes a ring's name: every call still returns, and
    the faults are counted."""
    store = tmp_path / "store"
    seqs = sequences(4, PAGE_TOKENS, seed=6)
    sup = start_supervisor(store, instance)
    engine = SyntheticEngine.create(make_cfg(store, instance))
    try:
        for sid, tokens in seqs.items():
            assert engine.publish(sid, tokens)
        engine.drain()
        assert engine.acknowledged == set(seqs)
        rc, err = stop_supervisor(sup)
        assert rc == 0, err[-2000:]
        client = engine.client
        for tokens in seqs.values():  # connected to rings nobody serves any more
            assert client.publish("after", tokens, list(range(8))) is False
            client.poll_completions()
            client.poll_durable()
            assert client.lookup(tokens) == len(tokens)  # the store is still on disk
        # Capture found stopped, the client looked for a successor and found none.
        assert client.counters.skipped["supervisor_absent"] == len(seqs)
        impostor = Ring.create(segments.name(instance, 0, "completion"), FREED, 8)
        try:  # a segment of another layout under a ring's name
            client._next_connect = 0.0
            assert client.publish("again", seqs["seq-0"], list(range(8))) is False
            assert client.poll_completions() == [] and client.poll_durable() == []
            assert client.counters.skipped["supervisor_absent"] == len(seqs) + 1
        finally:
            impostor.close()
    finally:
        engine.close()
        if sup.poll() is None:
            stop_supervisor(sup)


def test_vllm_033_views_publish_and_restore_byte_exact() -> None:
    """vLLM 0.33 hands a connector ``[blocks, heads, block size, K+V]`` views over LBNHC
    memory, not contiguous (or over LBHNC memory, contiguous): registered with
    ``block_size_dim=2`` they publish and restore byte-exact through a real supervisor
    (``scripts/check_cuda.py`` on shared-memory tensors; the same script checks CUDA IPC
    on a GPU)."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "check_cuda.py"
    done = subprocess.run([sys.executable, str(script), "--device", "cpu", "--sequences", "8"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    layouts = {r["layout"]: r for r in json.loads(done.stdout)["layouts"]}
    assert not layouts["vllm-0.33"]["contiguous"] and layouts["vllm-0.33-hnd"]["contiguous"]
    for r in layouts.values():
        assert r["pages_byte_exact"] == r["pages"] == r["pages_restored"] > 0, r
        assert r["durable"] == r["sequences"], r
        assert r["pages_loaded_byte_exact"] == r["pages"], r
        assert r["loads_ok"] == r["sequences"], r
        # Every page loaded (and the warm-up's one) was read from a cold store: where it
        # is on a disk, a pack's pages past the page cache (the path a GPU's staging is
        # fed by), a one-page delta's object file through it.
        read = r["load_read_bytes"]
        assert sum(read.values()) == (r["pages"] + 1) * r["page_bytes"], r
        if r["store_filesystem"] not in MEMORY_FILESYSTEMS:
            assert read["cached"] == 0 and read["direct"] > read["buffered"], r


# More pages than half the publish ring's 32,768 records: two such publications do not fit
# in it together.
RING_HALF_PLUS = segments.RINGS["publish"][1] // 2 + 16


@contextlib.contextmanager
def _capture_stopped(tmp_path: Path, instance: str, **cfg: str):
    """A client of 4 KiB pages beside a supervisor whose capture worker is stopped
    (SIGSTOP): yields the client and ``resume()``, which lets capture run again."""
    kv = SharedKVCaches.create(instance, 0, [SHAPE], torch.float16)
    c = SparkCacheClient(make_cfg(tmp_path / "store", instance, **cfg), 0, model_id="m")
    sup = start_supervisor(tmp_path / "store", instance)
    stopped: list[int] = []

    def resume() -> None:
        while stopped:
            os.kill(stopped.pop(), signal.SIGCONT)

    try:
        assert c.register_kv_caches(kv.tensors)
        wait_for(lambda: c._connection() is not None and c._conn.worker_alive(Role.CAPTURE),
                 30, "capture up")
        stopped.append(int(c._conn.stats.read(int(Role.CAPTURE)).pid))
        os.kill(stopped[0], signal.SIGSTOP)
        yield c, resume
    finally:
        resume()
        c.close()
        stop_supervisor(sup)
        kv.close()


def test_the_pending_limit_counts_sequences_and_keeps_room_for_final_saves(
        tmp_path: Path, instance: str) -> None:
    """Capture stopped, so publications stay pending: 4 slots, a limit of 8 sequences.
    Partial publications (a running request's pages so far) are taken for 4 sequences
    only; another of a sequence already pending is taken however full it is (a sequence
    counts once), and so are final ones up to 8 sequences. Each pending one is released
    by its deadline."""
    with _capture_stopped(tmp_path, instance, release_timeout_seconds="2") as (c, _):
        keys = [f"{i:032x}" for i in range(2)]
        limit = c.max_pending
        assert limit == 8
        for i in range(limit // 2):
            assert c.publish_keys(f"run{i}", keys, [2 * i, 2 * i + 1], partial=True)
        assert not c.publish_keys("run-late", keys, [20, 21], partial=True)
        assert c.counters.skipped["pending_limit"] == 1
        assert c.publish_keys("run0", keys, [0, 1], partial=True)  # counted once
        for i in range(limit // 2):
            assert c.publish_keys(f"fin{i}", keys, [30 + i, 40 + i])
        assert c.pending == limit + 1
        assert not c.publish_keys("fin-late", keys, [50, 51])
        assert c.publish_keys("fin0", keys, [30, 40])  # counted once
        assert c.counters.skipped["pending_limit"] == 2
        released = wait_for(lambda: c.poll_completions(), 10, "the deadline's release")
        assert {d.status for d in released} == {"expired"}


def test_a_publications_deadline_covers_the_pages_lent_before_it() -> None:
    """Capture copies publications in order, so one queued behind an arena's worth of
    others is lent one timeout more; the client counts at most PUBLISH_AHEAD_MAX_PAGES
    ahead, and capture's bound (that most ahead) is never below a deadline it sets."""
    arena, page = 1 << 30, 64 << 10
    assert release_seconds(5.0, 10 * page, arena) == 5.0
    assert release_seconds(5.0, 10 * page, arena, ahead_bytes=arena) == 10.0
    assert release_seconds(5.0, arena + page, arena, ahead_bytes=2 * arena) == 20.0
    bound = release_seconds(5.0, page, arena, segments.PUBLISH_AHEAD_MAX_PAGES * page)
    for ahead in (0, 1000, segments.PUBLISH_AHEAD_MAX_PAGES):
        assert release_seconds(5.0, page, arena, ahead * page) <= bound


def test_a_publication_the_ring_has_no_room_for_waits_its_turn_and_is_stored(
        tmp_path: Path, instance: str) -> None:
    """Capture stopped, two publications of more than half the publish ring each: the
    second is taken (not skipped as ``ring_full``) and waits in the client; once capture
    runs again it is pushed, and both are durable and restore."""
    with _capture_stopped(tmp_path, instance) as (c, resume):
        blocks = [i % BLOCKS for i in range(RING_HALF_PLUS)]
        keys = {name: [os.urandom(16).hex() for _ in blocks] for name in ("a", "b")}
        for name, ks in keys.items():
            assert c.publish_keys(name, ks, blocks), c.counters.skipped
        assert c.counters.publications_queued == 1 and c.pending == 2
        # 5 s for each 4 MiB arena of its pages (64 MiB: 17), and the second for the
        # first's too, queued ahead of it (33), not for its own alone.
        first, second = (p.deadline - p.lent_at for p in c._pending.values())
        assert first == pytest.approx(85, abs=1) and second == pytest.approx(165, abs=1)
        resume()
        settled: dict = {}

        def both() -> bool:
            c.poll_completions()
            settled.update((d.seq_id, d) for d in c.poll_durable())
            return len(settled) == 2

        wait_for(both, 120, "both publications durable")
        assert all(d.durable for d in settled.values()), settled
        assert not c.counters.skipped
        reader = StoreReader(tmp_path / "store", 0)
        try:
            for ks in keys.values():
                assert len(reader.plan(ks)) == len(ks)
        finally:
            reader.close()


def test_a_waiting_publication_released_by_its_deadline_is_never_pushed(
        tmp_path: Path, instance: str) -> None:
    """The second publication waits for room while capture is stopped, and its deadline
    passes: it is released (expired) and dropped from the wait, so capture never gets
    it once it runs again (its blocks may be the engine's again by then)."""
    with _capture_stopped(tmp_path, instance, release_timeout_seconds="0.02") as (c, resume):
        blocks = [i % BLOCKS for i in range(RING_HALF_PLUS)]
        for name in ("a", "b"):
            assert c.publish_keys(name, [os.urandom(16).hex() for _ in blocks], blocks)
        assert c.counters.publications_queued == 1
        released: list = []
        wait_for(lambda: released.extend(c.poll_completions()) or len(released) == 2, 30,
                 "both released by their deadlines")
        assert {r.status for r in released} == {"expired"} and c.pending == 0
        resume()
        ring = Ring.attach(segments.name(instance, 0, "publish"), PUBLISH)
        try:
            wait_for(lambda: ring.depth() == 0, 30, "capture took what was pushed")
            time.sleep(0.5)
            c.poll_completions()  # a poll pushes whatever waits: nothing may
            assert ring.batch_counts()[0] == 1  # "a" alone
        finally:
            ring.close()
