"""SparkCache's connector under vLLM 0.33's real Scheduler, with a real supervisor."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import pickle
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from sparkcache import kvmem
from sparkcache.identity import Namespace, chain_seed, sequence_keys
from sparkcache.store import PageStore
from sparkcache.store.layout import RankLayout
from sparkcache.store.objects import HEADER_SIZE
from sparkcache.store.reader import StoreReader
from sparkcache.store.records import PageData, Root
from sparkcache.store.testing import object_file
from tests.pipeline_util import start_supervisor, stop_supervisor

pytest.importorskip("vllm.v1.core.kv_cache_planning", reason="needs vLLM 0.33's scheduler")

from vllm.lora.request import LoRARequest
from vllm.v1.request import Request

from sparkcache.vllm.request_keys import request_extras
from tests.with_vllm.harness import BLOCK, request, rig


def run_turn(r, rid: str, prompt: list[int], max_tokens: int = 2, **kw: Any) -> Request:
    req = request(rid, prompt, max_tokens, **kw)
    r.sched.add_request(req)
    r.run_until_idle()
    return req


def wait_stored(r, pages: int, timeout: float = 30.0) -> None:
    """Step an idle scheduler until the scheduler side's lookup sees ``pages`` pages of a
    probe request (what the next turn will look up)."""
    side = r.sched.get_kv_connector()._scheduler
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r.step()
        if side.namespace() is not None:
            # Readers snapshot per call: a plain count of live roots is enough here.
            readers = [side.lookup._reader(rank) for rank in range(r.tp)]
            if all(rd.conn.execute("SELECT COALESCE(SUM(pages),0) FROM roots").fetchone()[0]
                   >= pages for rd in readers):
                return
        time.sleep(0.05)
    raise AssertionError(f"{pages} pages not stored within {timeout}s")


def registered_namespace(store: Path) -> Namespace:
    return Namespace(**kvmem.read_registry(store, 0)["namespace"])


def derived_keys(store: Path, req: Request, algo: str = "sha256") -> list[str]:
    """The page keys of ``req`` as docs/store.md defines those derived from vLLM's block
    hashes, one page at a time: the first 16 bytes of the hash of the page's last block
    XOR blake2b-128(person "sparkcache-vllmh", chain seed || algorithm)."""
    ns = registered_namespace(store)
    seed = hashlib.blake2b(chain_seed(ns, request_extras(req)) + algo.encode(),
                           digest_size=16, person=b"sparkcache-vllmh").digest()
    per_page = ns.page_tokens // BLOCK
    return [bytes(a ^ b for a, b in zip(vh[:16], seed, strict=True)).hex()
            for vh in req.block_hashes[per_page - 1 :: per_page]]


def prefix_keys(store: Path, tokens: list[int]) -> list[str]:
    """The page keys the scheduler side computes for a plain request of ``tokens`` (one
    list for every rank)."""
    return derived_keys(store, request("keys", tokens))


def stored_keys(store: Path, rank: int) -> list[list[str]]:
    """The page keys of each root ``rank``'s store holds, in page order."""
    reader = StoreReader(store, rank)
    try:
        roots: dict[str, list[str]] = {}
        for root, key in reader.conn.execute(
                "SELECT root_id, key FROM root_pages ORDER BY root_id, pos"):
            roots.setdefault(root, []).append(key)
        return list(roots.values())
    finally:
        reader.close()


def object_of(store: Path, rank: int, key: str) -> tuple[Path, int]:
    """The file holding ``key``'s page in ``rank``'s store (its own, or its publication's
    pack), and the offset of its record there."""
    reader = StoreReader(store, rank)
    try:
        return object_file(reader.layout.objects_dir, reader.conn, key)
    finally:
        reader.close()


def load_turn(r, rid: str, prompt: list[int], **kw: Any):
    """Add ``rid`` and step until its load has ended; the blocks it loaded, page by
    page (the load starts at page 0: the scheduler has no prefix caching)."""
    r.sched.add_request(request(rid, prompt, max_tokens=2, **kw))
    # The restore worker's first load opens the KV registration (seconds on a cold start).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r.step()
        if rid in r.finished_recving:
            return r.loads[rid]
        time.sleep(0.01)
    raise AssertionError(f"{rid}: no load ended")


@contextmanager
def running_supervisor(store: Path, instance: str, *extra: str):
    proc = start_supervisor(store, instance, *extra)
    try:
        yield store
    finally:
        code, err = stop_supervisor(proc)
        assert code == 0, err[-2000:]


@pytest.fixture
def supervisor(tmp_path: Path, instance: str):
    with running_supervisor(tmp_path / "store", instance) as store:
        yield store


@pytest.mark.parametrize("kv_memory", ["adopted", "staged"])
def test_first_turn_saved_second_loaded_async_byte_exact(
        supervisor: Path, instance: str, kv_memory: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's private CPU KV moved into shared memory (capture and restore reach its
    blocks), or, where that cannot be done, pages copied through a staging pool."""
    if kv_memory == "staged":
        monkeypatch.setattr(kvmem, "can_adopt", lambda: False)
    prefix = list(range(10, 10 + 5 * BLOCK))  # 5 full pages
    with rig(supervisor, instance) as r:
        worker = r.workers[0]._worker
        assert (worker.shared_kv is not None) == (kv_memory == "adopted")
        assert (worker.staging is not None) == (kv_memory == "staged")
        run_turn(r, "A", [*prefix, 7, 8, 9])
        assert "A" in r.finished_sending  # its blocks were held until saved, then freed
        wait_stored(r, 5)
        r.sched.add_request(request("B", prefix + list(range(300, 310)), max_tokens=2))
        so = r.step()
        # An async load: B waits for the load, nothing of it is computed yet.
        assert not so.num_scheduled_tokens.get("B")
        deadline = time.monotonic() + 30
        while "B" not in r.finished_recving and time.monotonic() < deadline:
            r.step()
            time.sleep(0.01)
        assert "B" in r.finished_recving and not r.load_errors
        table = r.loads["B"]
        so = r.step()
        assert so.num_scheduled_tokens["B"] == len(prefix) + 10 - 5 * BLOCK
        for page in range(5):
            assert r.block_holds(0, table[page], prefix[page * BLOCK:(page + 1) * BLOCK],
                                 page * BLOCK), f"page {page} not restored exactly"
        r.run_until_idle()


def test_sleep_mode_is_refused_and_hits_are_reported_as_disk(tmp_path: Path,
                                                              monkeypatch) -> None:
    """Sleep mode frees and remaps the KV cache capture and restore hold mapped: vLLM's own
    check of a config asks the connector (through its factory) and refuses the
    combination. (This CPU platform refuses sleep mode before that, so the model config
    is told it is on after it was made.) Hits are the disk tier's where vLLM reports hits
    by tier (0.33); the CPU engine's vLLM has no tiers."""
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig

    from sparkcache.vllm.connector import SparkCacheConnector

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6, "torch_dtype": "float16", "head_dim": 64}))
    config = VllmConfig(
        model_config=ModelConfig(model=str(tmp_path), dtype="bfloat16", seed=0,
                                 skip_tokenizer_init=True, max_model_len=1024),
        cache_config=CacheConfig(block_size=BLOCK),
        kv_transfer_config=KVTransferConfig(kv_connector="SparkCacheConnector",
                                            kv_connector_module_path="sparkcache.vllm",
                                            kv_role="kv_both"),
        device_config=DeviceConfig("cpu"))
    object.__setattr__(config.model_config, "enable_sleep_mode", True)
    with pytest.raises(ValueError, match="SparkCacheConnector does not support sleep mode"):
        config._verify_kv_transfer_compat()
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        return
    assert SparkCacheConnector._cache_hit_source is CacheHitSource.DISK


def test_a_load_failure_policy_other_than_recompute_is_set_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's default policy fails a request whose load reported a bad block; the
    connector sets "recompute" and says so, naming what was asked. The launch config of
    docs/vllm.md asks for "recompute": nothing said."""
    from vllm.config import KVTransferConfig

    from sparkcache.vllm.connector import _recompute_failed_loads

    for asked, warned in (("fail", True), ("recompute", False)):
        transfer = KVTransferConfig(kv_connector="SparkCacheConnector", kv_role="kv_both",
                                    kv_load_failure_policy=asked)
        caplog.clear()
        with caplog.at_level(logging.WARNING, "sparkcache.vllm.connector"):
            _recompute_failed_loads(transfer)
        assert transfer.kv_load_failure_policy == "recompute"
        assert ("kv_load_failure_policy 'fail' set to 'recompute'" in caplog.text) is warned
        assert bool(caplog.records) is warned


def test_reset_cache_after_a_weight_update_misses_what_was_stored_before(
        supervisor: Path, instance: str) -> None:
    """vLLM resets the connector's cache after a weight update
    (``reset_prefix_cache(reset_connector=True)``): the reset succeeds, the next turn
    does not load the pages stored before it (KV of the old weights), and what that turn
    saves is found by the turn after."""
    prefix = list(range(900, 900 + 5 * BLOCK))
    with rig(supervisor, instance) as r:
        run_turn(r, "A", [*prefix, 1])
        wait_stored(r, 5)
        side = r.sched.get_kv_connector()._scheduler
        assert r.sched.reset_prefix_cache(reset_connector=True) is True
        run_turn(r, "B", [*prefix, 2])
        assert "B" not in r.loads  # missed: nothing of before the reset is looked up
        wait_stored(r, 10)  # B's five pages, under keys of their own beside A's
        table = load_turn(r, "C", [*prefix, 3])
        assert not r.load_errors
        for page in range(5):
            assert r.block_holds(0, table[page], prefix[page * BLOCK:(page + 1) * BLOCK],
                                 page * BLOCK), f"page {page} not restored exactly"
        r.run_until_idle()
    assert side.counters["resets"] == 1


def test_a_request_that_reads_no_prefix_cache_is_not_looked_up(
        supervisor: Path, instance: str) -> None:
    """A request asking to read no prefix cache (``skip_reading_prefix_cache``, as vLLM
    sets it for prompt logprobs) gets no load, and the store is not asked: no lookup, no
    lease, no hit counted. vLLM 0.33 drops such a hit itself; the connector's lookup
    took a lease and counted a hit never loaded. Its pages are still saved."""
    prefix = list(range(700, 700 + 5 * BLOCK))
    with rig(supervisor, instance) as r:
        run_turn(r, "A", [*prefix, 1])
        wait_stored(r, 5)
        side = r.sched.get_kv_connector()._scheduler
        lookups, hits = side.counters["lookups"], side.counters["hit_tokens"]
        req = request("B", [*prefix, *range(5000, 5000 + 3 * BLOCK)])
        req.skip_reading_prefix_cache = True
        r.sched.add_request(req)
        r.run_until_idle()
        assert "B" not in r.loads
        assert (side.counters["lookups"], side.counters["hit_tokens"]) == (lookups, hits)
        assert side.counters["lookup_skip_reading"] >= 1
        assert side.totals()["skipped:lookup_skip_reading"] >= 1
        wait_stored(r, 8)  # B's own three pages after the prefix, saved as it finished


def test_with_a_draft_model_the_hits_last_page_is_not_loaded(supervisor: Path,
                                                              instance: str) -> None:
    """Where vLLM drops its own hits' last block for a draft model (settings'
    ``drop_last_page``), the store's hit ends a page short too: that page's draft KV was
    computed with a next token this request may not have. vLLM computes it."""
    import dataclasses

    prefix = list(range(1200, 1200 + 5 * BLOCK))
    with rig(supervisor, instance) as r:
        run_turn(r, "A", [*prefix, 1])
        wait_stored(r, 5)
        side = r.sched.get_kv_connector()._scheduler
        asked = request("B", [*prefix, 2, 3])
        assert side.get_num_new_matched_tokens(asked, 0) == (5 * BLOCK, True)
        side._reqs.pop("B")
        side.settings = dataclasses.replace(side.settings, drop_last_page=True)
        again = request("C", [*prefix, 2, 3])
        assert side.get_num_new_matched_tokens(again, 0) == (4 * BLOCK, True)
        assert side.get_num_new_matched_tokens(again, 4 * BLOCK) == (0, False)


PLAIN, SALT, LORA = {}, {"cache_salt": "tenant-a"}, {"lora_request": LoRARequest("ad", 1, "/ad")}


@pytest.mark.parametrize("extras", [PLAIN, SALT, LORA], ids=["plain", "salt", "lora"])
def test_the_scheduler_looks_up_the_keys_the_worker_side_published(
        supervisor: Path, instance: str, extras: dict, caplog: pytest.LogCaptureFixture) -> None:
    """With vLLM's default hash (SHA-256) the scheduler side derives page keys from the
    request's block hashes: the worker side publishes exactly those (docs/store.md's
    definition, computed here page by page), and the next turn's lookup finds them and
    its load restores the bytes. A salt or an adapter changes every key, as it changes
    every vLLM block hash."""
    prefix = list(range(500, 500 + 5 * BLOCK))
    with caplog.at_level(logging.INFO, "sparkcache.vllm.scheduler_side"), \
            rig(supervisor, instance) as r:
        first = run_turn(r, "A", [*prefix, 1], **extras)
        wait_stored(r, 5)
        want = derived_keys(supervisor, first)[:5]
        assert stored_keys(supervisor, 0) == [want]
        plain = prefix_keys(supervisor, prefix)
        assert (want == plain) == (extras is PLAIN)
        assert not set(want) & set(sequence_keys(registered_namespace(supervisor), prefix).pages)
        table = load_turn(r, "B", [*prefix, 2, 3], **extras)
        assert not r.load_errors
        for page in range(5):
            assert r.block_holds(0, table[page], prefix[page * BLOCK:(page + 1) * BLOCK],
                                 page * BLOCK), f"page {page} not restored exactly"
        r.run_until_idle()
    assert "page keys derived from vLLM's sha256 block hashes" in caplog.text


def python_hash(obj: object) -> bytes:
    """Python's hash as vLLM's block hash: the non-cryptographic kind (vLLM's own,
    xxhash, needs a package this environment leaves out)."""
    return hash(pickle.dumps(obj)).to_bytes(8, "little", signed=True) * 2


def test_a_non_cryptographic_hash_keys_pages_from_the_tokens(
        supervisor: Path, instance: str, caplog: pytest.LogCaptureFixture) -> None:
    """With ``prefix_caching_hash_algo`` xxhash nothing is taken from vLLM's hashes, where
    a collision could be made: keys are hashed from the tokens (identity.sequence_keys),
    with no memo, and a warning says so; the worker side publishes those and the next
    turn loads them."""
    prefix = list(range(900, 900 + 5 * BLOCK))
    with caplog.at_level(logging.INFO, "sparkcache.vllm.scheduler_side"), \
            rig(supervisor, instance, hash_algo="xxhash") as r:
        run_turn(r, "A", [*prefix, 1], hash_fn=python_hash)
        wait_stored(r, 5)
        assert stored_keys(supervisor, 0) == [
            list(sequence_keys(registered_namespace(supervisor), prefix).pages)]
        table = load_turn(r, "B", [*prefix, 2, 3], hash_fn=python_hash)
        assert not r.load_errors
        assert r.block_holds(0, table[4], prefix[4 * BLOCK:], 4 * BLOCK)
        side = r.sched.get_kv_connector()._scheduler
        assert side.key_source.algo is None and not side.key_source.memo
        assert side._reqs["B"].keys.memo_pages == 0
        r.run_until_idle()
    warned = [rec for rec in caplog.records if rec.levelno == logging.WARNING
              and "hashed from the tokens" in rec.getMessage()]
    assert len(warned) == 1 and "'xxhash' is not collision resistant" in warned[0].getMessage()


def test_metadata_is_bound_only_for_steps_with_loads_or_saves(
        supervisor: Path, instance: str) -> None:
    """vLLM runs its per-layer hooks (the layer's attention context, wait_for_layer_load,
    save_kv_layer) only while a connector has metadata bound: decode steps, which neither
    load nor save, bind none, and the saves and loads of the others still happen."""
    prefix = list(range(20, 20 + 4 * BLOCK))
    with rig(supervisor, instance) as r:
        worker = r.workers[0]
        steps: list[tuple[bool, bool]] = []  # (the step's metadata had work, it was bound)
        real_bind = worker.bind_connector_metadata

        def bind(meta) -> None:
            real_bind(meta)
            steps.append((bool(meta.loads or meta.saves), worker.has_connector_metadata()))

        worker.bind_connector_metadata = bind
        run_turn(r, "A", [*prefix, 7], max_tokens=6)
        assert "A" in r.finished_sending
        wait_stored(r, 4)
        assert load_turn(r, "B", [*prefix, 8, 9]) and not r.load_errors
        r.run_until_idle()
        assert all(work == bound for work, bound in steps), steps
        assert sum(work for work, _ in steps) == 3  # A's save, B's load, B's save
        assert sum(not work for work, _ in steps) >= 5  # A's decode steps among them


def test_tp2_loads_the_shortest_prefix_across_ranks(tmp_path: Path, instance: str) -> None:
    prefix = list(range(40, 40 + 5 * BLOCK))
    with running_supervisor(tmp_path / "store", instance, "--ranks", "2") as store, \
            rig(store, instance, tp=2) as r:
        run_turn(r, "A", [*prefix, 1, 2])
        wait_stored(r, 5)
        # Rank 1 keeps only pages 0-2 (its root replaced by a shorter one with the same
        # bytes): every rank can restore only those.
        keys = prefix_keys(store, prefix)
        reader = StoreReader(store, 1)
        try:
            size = reader.conn.execute("SELECT bytes FROM objects WHERE key = ?",
                                       (keys[0],)).fetchone()[0]
            pages = [bytearray(size) for _ in range(3)]
            assert reader.restore(keys[:3], pages).pages == 3
        finally:
            reader.close()
        with PageStore(store, 1, clock=lambda: float("inf")) as st:  # every lease over
            ids = [row[0] for row in st._wconn.execute("SELECT id FROM roots")]
            assert st.remove_roots(ids).removed
        with PageStore(store, 1) as st:
            st.commit(Root("c" * 32, [PageData(k, bytes(p))
                                      for k, p in zip(keys[:3], pages, strict=True)]))
        table = load_turn(r, "B", [*prefix, 3, 4, 5])
        assert not r.load_errors
        for rank in (0, 1):
            for page in range(3):
                assert r.block_holds(rank, table[page], prefix[page * BLOCK:(page + 1) * BLOCK],
                                     page * BLOCK), (rank, page)
        so = r.step()
        assert so.num_scheduled_tokens["B"] == len(prefix) + 3 - 3 * BLOCK
        r.run_until_idle()


def test_a_corrupt_page_is_a_load_error_and_recomputed(supervisor: Path, instance: str) -> None:
    prefix = list(range(70, 70 + 5 * BLOCK))
    with rig(supervisor, instance) as r:
        run_turn(r, "A", [*prefix, 1])
        wait_stored(r, 5)
        bad_key = prefix_keys(supervisor, prefix)[2]
        path, offset = object_of(supervisor, 0, bad_key)
        data = bytearray(path.read_bytes())
        data[offset + HEADER_SIZE + 17] ^= 0xFF  # a byte of the page
        path.write_bytes(bytes(data))
        table = load_turn(r, "B", [*prefix, 2, 3])
        # Pages 0-1 restored; page 2 failed verification: its block and the ones after
        # are reported, and vLLM computes them.
        assert set(table[2:5]) <= r.load_errors and not set(table[:2]) & r.load_errors
        for page in range(2):
            assert r.block_holds(0, table[page], prefix[page * BLOCK:(page + 1) * BLOCK],
                                 page * BLOCK)
        so = r.step()
        assert so.num_scheduled_tokens["B"] == len(prefix) + 2 - 2 * BLOCK
        r.run_until_idle()
        for page in range(5):  # recomputed: right bytes everywhere
            assert r.block_holds(0, table[page], prefix[page * BLOCK:(page + 1) * BLOCK],
                                 page * BLOCK)
        # The bad object was sent to maintenance, which quarantines it: its record is
        # kept under its own key and its pack's generation.
        kept = (RankLayout(supervisor, 0).quarantine_dir
                / f"{bad_key}.{path.name.split('.')[1]}")
        deadline = time.monotonic() + 15
        while not kept.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert kept.exists()


def test_no_supervisor_every_request_completes(tmp_path: Path, instance: str) -> None:
    prefix = list(range(5, 5 + 4 * BLOCK))
    with rig(tmp_path / "store", instance) as r:
        for i in range(3):
            r.sched.add_request(request(f"R{i}", [*prefix, i], max_tokens=3))
        r.sched.add_request(request("short", [1, 2, 3], max_tokens=3))  # no full page
        r.run_until_idle()
        assert {"R0", "R1", "R2"} <= r.finished_sending or not r.finished_sending
        # Nothing is kept of a finished request once reported (or never saved).
        assert not r.workers[0]._worker._finished
        assert not r.finished_recving and not r.load_errors
        side = r.sched.get_kv_connector()._scheduler
        assert side.lookup.misses  # counted, not raised


def test_a_rank_that_could_not_register_answers_every_load_and_save(
        supervisor: Path, instance: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker side that failed to register the KV caches, while the scheduler side (its
    own process in vLLM) finds registrations a run before left: loads are answered with
    every block a load error (recomputed), saves unsaved, and every request completes
    and frees its blocks, the aborted one too, instead of waiting on a worker that will
    never report."""
    from vllm.v1.request import RequestStatus

    from sparkcache import staging

    prefix = list(range(10, 10 + 5 * BLOCK))
    with rig(supervisor, instance) as r:  # the run before: its registry stays behind
        run_turn(r, "A", [*prefix, 7])
        wait_stored(r, 5)
    monkeypatch.setattr(kvmem, "can_adopt", lambda: False)

    def no_room(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(staging.StagingPool, "__init__", no_room)
    with rig(supervisor, instance) as r:
        assert r.workers[0]._worker is None  # disabled: the registration failed
        free = r.sched.kv_cache_manager.block_pool.get_num_free_blocks()
        for rid in ("B", "D"):
            r.sched.add_request(request(rid, [*prefix, 2, 3], max_tokens=2))
        r.sched.add_request(request("C", list(range(900, 900 + 3 * BLOCK + 1)), max_tokens=2))
        r.step()
        assert {"B", "D"} <= set(r.loads)  # the stale registry made them hits
        r.sched.finish_requests(["D"], RequestStatus.FINISHED_ABORTED)
        r.run_until_idle(timeout=20)
        assert {"B", "D"} <= r.finished_recving and "C" in r.finished_sending
        assert set(r.loads["B"][:5]) <= r.load_errors  # computed, not taken as loaded
        assert r.sched.kv_cache_manager.block_pool.get_num_free_blocks() == free


def test_scheduler_side_answers_what_vllm_relies_on(
        supervisor: Path, instance: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Called directly, as vLLM calls it: asked again about a request in the same state
    (vLLM re-asks every step while the request waits for blocks), the same answer, with no
    new lookup or lease; a finished request's save leaves out the tokens of a step still in
    flight (async scheduling: not written yet on a GPU); a load with fewer blocks than its
    pages still goes to the worker, which reports those blocks load errors; vLLM taking
    fewer tokens than answered gets a load of the pages it took a token of; and a
    registration whose engine is gone is no namespace (its worker side is not serving).
    And a request whose load came back with a load error, reported a step before the
    load ended (another rank's), gets no other load."""
    import psutil
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

    from sparkcache import registry
    from sparkcache.vllm import scheduler_side

    monkeypatch.setattr(scheduler_side, "ANSWER_REUSE_S", 3600.0)  # a slow lookup's time

    prefix = list(range(800, 800 + 5 * BLOCK))
    with rig(supervisor, instance) as r:
        run_turn(r, "A", [*prefix, 1])
        wait_stored(r, 5)
        side = r.sched.get_kv_connector()._scheduler
        lookups = side.lookup.lookups
        asked = request("B", [*prefix, 2, 3])
        first = side.get_num_new_matched_tokens(asked, 0)
        assert first == (5 * BLOCK, True)
        assert side.get_num_new_matched_tokens(asked, 0) == first
        assert side.lookup.lookups == lookups + 1  # one lookup, one lease
        side._reqs["B"].answer_until = 0.0  # the answer's time is up: the store again
        assert side.get_num_new_matched_tokens(asked, 0) == first
        assert side.lookup.lookups == lookups + 2

        class FiveBlocks:
            def get_block_ids(self) -> tuple[list[int], ...]:
                return (list(range(30, 35)),)

        class TwoBlocks:  # fewer blocks than the load's five pages
            def get_block_ids(self) -> tuple[list[int], ...]:
                return ([3, 4],)

        hits = side.totals()["hit_tokens"]  # counted at admission, not at lookup
        side.update_state_after_alloc(asked, TwoBlocks(), 5 * BLOCK)
        assert side.totals()["hit_tokens"] == hits + 5 * BLOCK
        meta = side.build_connector_meta(SchedulerOutput.make_empty())
        worker = r.workers[0]
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        assert worker.get_finished(set()) == (None, {"B"})
        assert worker.get_block_ids_with_load_errors() == {3, 4}
        worker.clear_connector_metadata()

        # vLLM takes fewer tokens than answered: the pages it takes any token of are
        # loaded, no more.
        for name, taken, loaded in (("F", 3 * BLOCK, [30, 31, 32]),
                                    ("G", BLOCK + 1, [30, 31])):
            fewer = request(name, [*prefix, 8, 9])
            assert side.get_num_new_matched_tokens(fewer, 0) == first
            hits = side.totals()["hit_tokens"]
            side.update_state_after_alloc(fewer, FiveBlocks(), taken)
            assert side.totals()["hit_tokens"] == hits + taken  # what vLLM took
            meta = side.build_connector_meta(SchedulerOutput.make_empty())
            [job] = meta.loads
            assert (job.pages, job.block_ids) == (len(loaded), loaded)
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            deadline = time.monotonic() + 30
            while not (done := worker.get_finished(set()))[1]:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert done == (None, {name}) and worker.get_block_ids_with_load_errors() == set()
            worker.clear_connector_metadata()
            side.update_connector_output(KVConnectorOutput(finished_recving={name}))
            side._reqs.pop(name)

        again = request("E", [*prefix, 6, 7])
        assert side.get_num_new_matched_tokens(again, 0) == first
        side.update_state_after_alloc(again, FiveBlocks(), 5 * BLOCK)
        side.build_connector_meta(SchedulerOutput.make_empty())
        side.update_connector_output(KVConnectorOutput(invalid_block_ids={32}))  # rank 1
        side.update_connector_output(KVConnectorOutput(finished_recving={"E"}))  # rank 0 too
        assert side.get_num_new_matched_tokens(again, 0) == (0, False)
        side._reqs.pop("E")

        finished = request("C", [*prefix, 4, 5])
        finished.num_computed_tokens = len(prefix) + 2
        finished.num_in_flight_tokens = 2 * BLOCK + 2  # the last two pages not written yet
        assert side.request_finished(finished, (list(range(20, 26)),))[0]
        assert side.build_connector_meta(SchedulerOutput.make_empty()).saves[0].pages == 3

        desc = registry.read_registry(supervisor, 0)
        gone = psutil.Popen(["true"])
        gone.wait()
        stale = {**desc, "owner_pid": gone.pid, "owner_start": time.time() - 1}
        stale.pop("reg_gen"), stale.pop("block_dim")
        registry.write_registry(supervisor, 0, desc["reg_gen"], desc["block_dim"], stale)
        fresh = scheduler_side.SchedulerSide(side.settings)
        try:
            assert fresh.namespace() is None
        finally:
            fresh.close()


def test_at_the_hard_cap_every_request_completes(tmp_path: Path, instance: str) -> None:
    """A store far over its cap: saves are refused and counted, lookups go on, nothing
    is held forever and nothing raises."""
    # Maintenance allowed next to no work: the store stays over its cap. (Leases do not
    # keep it there: at the cap they yield, docs/maintenance.md "Leases at the cap".)
    with running_supervisor(tmp_path / "store", instance, "--max-bytes", "16KiB",
                            "--low-watermark-bytes", "8KiB", "--maintenance-io-bytes-per-s",
                            "1", "--maintenance-slice-bytes", "1") as store, \
            rig(store, instance) as r:
        for i in range(6):
            prefix = list(range(100 * i, 100 * i + 4 * BLOCK))
            r.sched.add_request(request(f"C{i}", [*prefix, 9], max_tokens=2))
            r.run_until_idle()
            client = r.workers[0]._worker.client
            deadline = time.monotonic() + 20
            while (client.pending or client.awaiting_durable) and time.monotonic() < deadline:
                r.step()
                client.poll_durable()
                time.sleep(0.05)
            time.sleep(0.5)  # a maintenance pass reports the bytes used
        assert {f"C{i}" for i in range(6)} <= r.finished_sending
        assert not r.sched.requests
        skipped = sum((w._worker.client.counters.skipped for w in r.workers), Counter())
        assert skipped["store_full"] >= 1, skipped  # refused at the cap, counted


def test_counters_reach_vllm_stats_and_a_prometheus_scrape(tmp_path: Path,
                                                            instance: str) -> None:
    """What both sides count goes through vLLM's stats path (worker and scheduler
    reports aggregated) into the connector's Prometheus metrics, read back by HTTP. With
    two TP ranks, each rank's loads are its own series (a sum would count each token
    twice), and hits are what vLLM admitted."""
    import urllib.request

    from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server
    from prometheus_client import Counter as PromCounter

    from sparkcache.vllm import SparkCacheConnector

    prefix = list(range(900, 900 + 3 * BLOCK))
    with running_supervisor(tmp_path / "store", instance, "--ranks", "2") as store, \
            rig(store, instance, tp=2) as r:
        run_turn(r, "A", [*prefix, 1])
        wait_stored(r, 3)
        load_turn(r, "B", [*prefix, 2, 3])
        r.run_until_idle()
        # As vLLM's logger does: rebuild each payload and add them up.
        total = functools.reduce(
            lambda a, b: a.aggregate(b),
            [SparkCacheConnector.build_kv_connector_stats(p) for p in r.stats])
        data = total.reduce()
        assert data["loaded_tokens@rank0"] == data["loaded_tokens@rank1"] == 3 * BLOCK, data
        assert data["hit_tokens"] == 3 * BLOCK and "loaded_tokens" not in data, data
        assert data["lookups"] >= 2 and data["saves"] >= 1, data

        registry = CollectorRegistry()
        types = {t: functools.partial(t, registry=registry)
                 for t in (PromCounter, Gauge, Histogram)}
        prom = SparkCacheConnector.build_prom_metrics(
            r.sched.vllm_config, types, ["model_name", "engine"], {0: ["tiny", "0"]})
        prom.observe(total.to_dict(), 0)
        server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
        try:
            port = server.server_address[1]
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
            text = body.read().decode()
        finally:
            server.shutdown()
            thread.join(10)
        for rank in (0, 1):
            line = f'vllm:sparkcache_loaded_tokens_total{{engine="0",model_name="tiny",' \
                   f'rank="{rank}"}}'
            assert f"{line} {float(3 * BLOCK)}" in text, text
        line = 'vllm:sparkcache_hit_tokens_total{engine="0",model_name="tiny"}'
        assert f"{line} {float(3 * BLOCK)}" in text, text


def test_a_request_aborted_while_loading_keeps_its_blocks_until_the_load_ended(
        supervisor: Path, instance: str) -> None:
    """No byte of a load lands in a block vLLM gave to another request: an aborted
    request's blocks stay held while the restore worker may still write them."""
    import json
    import os
    import signal

    from vllm.v1.request import RequestStatus

    prefix = list(range(600, 600 + 5 * BLOCK))
    rt = json.loads((supervisor / "runtime.json").read_text())
    restore_pid = next(w["pid"] for w in rt["workers"] if w["role"] == "restore")
    with rig(supervisor, instance, num_blocks=16) as r:
        run_turn(r, "A", [*prefix, 1])
        wait_stored(r, 5)
        os.kill(restore_pid, signal.SIGSTOP)  # the load cannot end while we abort
        try:
            r.sched.add_request(request("B", [*prefix, 2, 3], max_tokens=2))
            for _ in range(3):
                r.step()
            assert "B" in r.loads and "B" not in r.finished_recving
            r.sched.finish_requests(["B"], RequestStatus.FINISHED_ABORTED)
            for _ in range(5):
                r.step()
            # Finished, but its blocks are held: vLLM waits for the load to be reported.
            assert "B" in r.sched.requests and "B" not in r.finished_recving
        finally:
            os.kill(restore_pid, signal.SIGCONT)
        deadline = time.monotonic() + 20
        while "B" not in r.finished_recving and time.monotonic() < deadline:
            r.step()
            time.sleep(0.02)
        assert "B" in r.finished_recving and "B" not in r.sched.requests
        # Every block is free again; a new request takes B's and keeps what it writes.
        c_prompt = list(range(5000, 5000 + 12 * BLOCK))
        r.sched.add_request(request("C", c_prompt, max_tokens=10))  # 13 of 15 blocks
        for _ in range(3):
            r.step()
        table = r.tables["C"]
        assert set(r.loads["B"]) & set(table), "C should reuse B's blocks (16 in all)"
        time.sleep(1.0)  # a late write from the load would land now
        for page in range(12):
            assert r.block_holds(0, table[page], c_prompt[page * BLOCK:(page + 1) * BLOCK],
                                 page * BLOCK), page
        r.run_until_idle()


def test_a_fault_in_get_finished_reports_every_job_once_no_worker_uses_its_blocks(
        supervisor: Path, instance: str) -> None:
    """After the worker side's ``get_finished`` raised, its bookkeeping is not trusted,
    but vLLM waits for every job: each is reported once the client says no worker uses
    its blocks (never sooner: a stopped restore worker's load and a stopped capture's
    save stay unreported, and a preemption waits for them), a load with all its blocks
    load errors; jobs handed over later are answered as an unserved rank's. Every
    request completes."""
    import json
    import os
    import signal
    import threading

    prefix = list(range(700, 700 + 5 * BLOCK))
    rt = json.loads((supervisor / "runtime.json").read_text())
    pids = {w["role"]: w["pid"] for w in rt["workers"]}
    with rig(supervisor, instance) as r:
        run_turn(r, "A", [*prefix, 1])
        wait_stored(r, 5)
        worker = r.workers[0]
        os.kill(pids["restore"], signal.SIGSTOP)
        os.kill(pids["capture"], signal.SIGSTOP)
        try:
            r.sched.add_request(request("B", [*prefix, 2, 3], max_tokens=2))  # a load
            r.sched.add_request(request("D", list(range(3000, 3000 + 3 * BLOCK)),
                                        max_tokens=1))  # a save, lent to capture
            for _ in range(4):
                r.step()
            assert "B" in r.loads and "B" not in r.finished_recving
            assert worker._worker._lent["D"], "D's save should be lent to capture"

            def broken(finished: set[str]) -> None:
                raise RuntimeError("bookkeeping fault")

            worker._worker.get_finished = broken
            for _ in range(5):
                r.step()
            assert worker.faults["get_finished"] == 1
            # Not reported while a stopped worker may still use the blocks.
            assert "B" not in r.finished_recving and "D" not in r.finished_sending
            # A preemption of D now waits, saving nothing, until capture is done with
            # its blocks.
            from sparkcache.vllm.metadata import PageJob, SparkCacheMetadata

            preempted = SparkCacheMetadata(preempted=[PageJob("D", b"", [])])
            waiting = threading.Thread(target=worker.handle_preemptions, args=(preempted,))
            waiting.start()
            waiting.join(0.5)
            assert waiting.is_alive()
        finally:
            os.kill(pids["restore"], signal.SIGCONT)
            os.kill(pids["capture"], signal.SIGCONT)
        waiting.join(30)
        assert not waiting.is_alive() and worker.faults["handle_preemptions"] == 0
        deadline = time.monotonic() + 30
        while not ({"B"} <= r.finished_recving and {"D"} <= r.finished_sending):
            assert time.monotonic() < deadline, (r.finished_recving, r.finished_sending)
            r.step()
            time.sleep(0.02)
        assert set(r.loads["B"]) <= r.load_errors  # computed by vLLM, every block
        # A load handed over since is answered as an unserved rank's: recomputed.
        r.load_errors.clear()
        r.sched.add_request(request("E", [*prefix, 4, 5], max_tokens=2))
        r.run_until_idle()
        assert set(r.loads["E"]) <= r.load_errors and "E" in r.finished_recving
        assert not r.sched.requests


def test_loads_beyond_the_ring_and_the_load_limit_wait_and_complete(
        supervisor: Path, instance: str) -> None:
    """More requests loading at once than the client's limit of loads in flight, their
    pages together more than the load ring holds: the loads that find no room wait in the
    client's queue, and every one completes without a load error."""
    from sparkcache import client as client_mod
    from sparkcache import segments

    ring = segments.RINGS["load"][1]
    pages = 2000 // BLOCK  # the longest prefix the tiny model's context leaves room for
    n = max(client_mod.MAX_LOADS, ring // pages) + 8
    prefix = list(range(20, 20 + pages * BLOCK))
    with rig(supervisor, instance, num_blocks=n * (pages + 2)) as r:
        run_turn(r, "A", [*prefix, 1])
        wait_stored(r, pages)
        rids = [f"L{i}" for i in range(n)]
        for i, rid in enumerate(rids):
            r.sched.add_request(request(rid, [*prefix, 7, i % 50, 9], max_tokens=2))
        r.step()
        client = r.workers[0]._worker.client
        assert set(rids) <= set(r.loads)  # every load asked for in the same step
        assert client.loads_waiting > 0  # no room for them all: queued, not refused
        # Some byte for byte, as their loads end: a request that ran and finished frees
        # blocks that later requests take for their tails.
        unchecked = {rids[0], rids[n // 2], rids[-1]}
        deadline = time.monotonic() + 300
        while not set(rids) <= r.finished_recving and time.monotonic() < deadline:
            r.step()
            for rid in unchecked & r.finished_recving:
                unchecked.discard(rid)
                for page in range(pages):
                    assert r.block_holds(0, r.loads[rid][page],
                                         prefix[page * BLOCK:(page + 1) * BLOCK],
                                         page * BLOCK), (rid, page)
            time.sleep(0.005)
        assert set(rids) <= r.finished_recving and not r.load_errors and not unchecked
        assert client.counters.load_status == {"ok": n}, client.counters.load_status
        assert not client.counters.misses and client.counters.loads_queued > 0
        assert n > client_mod.MAX_LOADS and n * pages > ring
        r.run_until_idle(timeout=300)


@pytest.mark.parametrize("cut", [True, False])
def test_a_load_slower_than_recomputing_is_cut_and_counted(
        supervisor: Path, instance: str, cut: bool) -> None:
    """The restore worker stalls for two seconds in a load (a disk busy with something
    else): at the rate that load measured, the next one would take longer than the engine
    takes to compute its tokens, so the request computes them instead, and the cut is
    counted in vLLM's stats. With ``cut_slow_loads`` off it is loaded, however slow."""
    import os
    import signal

    from sparkcache import runtime
    from sparkcache.vllm import SparkCacheConnector

    pages = 1000 // BLOCK
    prefix = list(range(40, 40 + pages * BLOCK))
    with rig(supervisor, instance, extra={"cut_slow_loads": cut}) as r:
        side = r.sched.get_kv_connector()._scheduler
        run_turn(r, "A", [*prefix, 1])  # prefill steps of 256 tokens: the compute rate
        wait_stored(r, pages)
        restore = next(w["pid"] for w in runtime.read(supervisor)["workers"]
                       if w["role"] == "restore")
        r.sched.add_request(request("B", [*prefix, 2, 3], max_tokens=2))
        os.kill(restore, signal.SIGSTOP)
        try:
            r.step()
            assert "B" in r.loads  # no rate measured yet: loaded
            time.sleep(2.0)
        finally:
            os.kill(restore, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while "B" not in r.finished_recving and time.monotonic() < deadline:
            r.step()
        assert "B" in r.finished_recving and not r.load_errors
        load_s, compute_s = side.cost.estimate(pages)
        # ~31 pages a second, against the stand-in forward's thousands of tokens a second
        # (the margin is for a slow machine: the cut needs only load_s > compute_s).
        print(f"estimates: load {load_s:.2f} s, compute {compute_s:.3f} s")
        assert load_s > 2.0 and load_s > compute_s, (load_s, compute_s)
        r.run_until_idle()
        c = run_turn(r, "C", [*prefix, 4, 5])
        assert ("C" in r.loads) is not cut
        # Either way the request's tokens are right: computed, or loaded exactly.
        table = r.tables["C"]
        for page in (0, pages - 1):
            assert r.block_holds(0, table[page], prefix[page * BLOCK:(page + 1) * BLOCK],
                                 page * BLOCK), page
        assert c.num_computed_tokens >= len(prefix)
        data = functools.reduce(lambda a, b: a.aggregate(b), [
            SparkCacheConnector.build_kv_connector_stats(p) for p in r.stats]).reduce()
        if cut:
            assert data["load_cuts"] == 1 and data["load_cut_tokens"] == pages * BLOCK, data
            assert data["hit_tokens"] == pages * BLOCK, data  # B's alone
        else:
            assert "load_cuts" not in data and data["hit_tokens"] == 2 * pages * BLOCK, data


@pytest.mark.parametrize("wait_s,stall_s", [(2.0, 0.6), (0.4, 1.5), (0.0, 0.6)])
def test_a_turn_sent_before_the_last_save_is_durable_waits_for_it(
        supervisor: Path, instance: str, wait_s: float, stall_s: float) -> None:
    """Turn B comes the moment turn A finished, while A's save is still being committed
    (the commit worker stopped for ``stall_s``): B's lookup is answered "later" until the
    save is durable, then B loads the whole prefix. A save not durable within
    ``save_wait_seconds`` is not waited for beyond it (B computes, the wait counted in
    vain); 0 never waits. Before, B missed and recomputed every page."""
    import os
    import signal

    from sparkcache import runtime
    from sparkcache.vllm import SparkCacheConnector

    pages = 5
    prefix = list(range(60, 60 + pages * BLOCK))
    with rig(supervisor, instance, extra={"save_wait_seconds": wait_s}) as r:
        commit = next(w["pid"] for w in runtime.read(supervisor)["workers"]
                      if w["role"] == "commit")
        os.kill(commit, signal.SIGSTOP)
        resumed = False
        try:
            run_turn(r, "A", [*prefix, 1])
            t0 = time.monotonic()
            r.sched.add_request(request("B", [*prefix, 2, 3], max_tokens=2))
            while "B" not in r.finished_recving and r.sched.requests.get("B") is not None \
                    and not r.sched.requests["B"].num_computed_tokens:
                if not resumed and time.monotonic() - t0 >= stall_s:
                    os.kill(commit, signal.SIGCONT)
                    resumed = True
                r.step()
                time.sleep(0.005)
                assert time.monotonic() - t0 < 30, "B neither loaded nor computed"
        finally:
            if not resumed:
                os.kill(commit, signal.SIGCONT)
        r.run_until_idle()
        data = functools.reduce(lambda a, b: a.aggregate(b), [
            SparkCacheConnector.build_kv_connector_stats(p) for p in r.stats]).reduce()
        if wait_s > stall_s:
            assert "B" in r.loads and not r.load_errors, data
            table = r.tables["B"]
            for page in (0, pages - 1):
                assert r.block_holds(0, table[page], prefix[page * BLOCK:(page + 1) * BLOCK],
                                     page * BLOCK), page
            assert data["save_waits"] == 1 and data["hit_tokens"] == pages * BLOCK, data
            assert stall_s - 0.1 <= data["save_wait_seconds"] < wait_s, data
            assert "save_waits_in_vain" not in data, data
        elif wait_s:
            assert "B" not in r.loads, data
            assert data["save_waits"] == 1 and data["save_waits_in_vain"] == 1, data
            # The bound is the save's age, which began a step before B's wait did.
            assert wait_s - 0.2 <= data["save_wait_seconds"] <= wait_s + 0.2 < stall_s, data
        else:
            assert "B" not in r.loads and "save_waits" not in data, data


def test_the_plugin_registers_the_connector_by_name_and_again_is_no_fault(
        caplog: pytest.LogCaptureFixture) -> None:
    """The installed entry point is what vLLM's plugin loader runs (in each process, maybe
    twice): after it, vLLM's factory resolves the bare name to the connector."""
    from importlib.metadata import entry_points

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from sparkcache.vllm import SparkCacheConnector

    [plugin] = [e for e in entry_points(group="vllm.general_plugins") if e.name == "sparkcache"]
    register = plugin.load()
    with caplog.at_level(logging.WARNING, logger="sparkcache"):
        register()
        register()  # a second load: nothing raised, nothing logged
    assert not caplog.records, caplog.records
    config = KVTransferConfig(kv_connector="SparkCacheConnector", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(config) is SparkCacheConnector


def test_three_waits_in_vain_in_a_row_stop_waits_for_a_while(tmp_path: Path) -> None:
    """A store that never makes saves durable (refusing at its cap, capture down) would
    cost every next turn its whole wait: after three waits in a row that ended with the
    save not stored, no request waits for ``WAITS_OFF_S``; one that does find its save
    stored counts the run from naught again."""
    from types import SimpleNamespace

    from sparkcache import config
    from sparkcache.identity import KEY_BYTES
    from sparkcache.vllm import scheduler_side
    from sparkcache.vllm.settings import Settings

    cfg = config.load(env={}, overrides={"store_dir": str(tmp_path / "store")},
                      check_store_dir=False)
    side = scheduler_side.SchedulerSide(Settings(cfg, "m", 1, BLOCK, 1 << 20, 0,
                                                 save_wait_s=0.5))
    side._found, side._find_at = None, float("inf")  # as if a supervisor served the store
    raw = bytes(range(KEY_BYTES)) * 4  # a request of 4 pages

    def request() -> SimpleNamespace:
        keys = SimpleNamespace(key_bytes=lambda a, b: raw[a * KEY_BYTES:b * KEY_BYTES],
                               expected_ends=lambda: ())  # no memo: every save compared
        return SimpleNamespace(keys=keys, waiting_since=0.0, waited_for=0)

    def turn(now: float, stored: int) -> bool:
        """A request of 4 pages, all covered by a save made at ``now``, of which
        ``stored`` are stored: True if it waited at all. Asked at ``now``, then every
        0.1 s until its answer stands."""
        side._saves.clear()
        side._saves[raw[-KEY_BYTES:]] = scheduler_side._SaveInFlight(4, now)
        state, waited, t = request(), False, now
        while side._waits_for_save(state, ["k"] * 4, stored, t):
            waited, t = True, t + 0.1
        return waited

    t = 1000.0
    for _ in range(scheduler_side.WAITS_IN_VAIN):
        assert turn(t, 0)  # waited 0.5 s, in vain
        t += 1
    assert side.counters["save_waits_in_vain"] == scheduler_side.WAITS_IN_VAIN
    assert not turn(t, 0)  # waits are off
    assert not turn(t + scheduler_side.WAITS_OFF_S - 1, 0)
    t += scheduler_side.WAITS_OFF_S + 1
    assert turn(t, 0)  # on again, and in vain once more
    # A wait that ends with its save stored starts the count again.
    side._saves[raw[-KEY_BYTES:]] = scheduler_side._SaveInFlight(4, t + 2)
    state = request()
    assert side._waits_for_save(state, ["k"] * 4, 0, t + 2)
    assert not side._waits_for_save(state, ["k"] * 4, 4, t + 2.1)
    assert side._waits_in_vain == 0
    assert side.counters["save_waits"] == scheduler_side.WAITS_IN_VAIN + 2
