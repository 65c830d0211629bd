"""vLLM 0.33's real ``Scheduler`` and SparkCache's worker-side connectors, driven step by
step on the CPU with a stand-in for the model: each step writes a value determined by
(token, position, layer, rank) into every KV slot it computes, so a restored block can
be checked byte for byte against what a recompute would write.

The step follows the order vLLM's model runner calls a connector in: bind the metadata,
start loads, the forward, wait for saves, collect finished transfers and load errors,
clear the metadata; with several TP ranks a transfer counts finished once every rank
reported it, as vLLM's output aggregator does."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.attention.backends.utils import (
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from sparkcache.vllm import connector as connector_mod
from sparkcache.vllm import settings as settings_mod

MODEL = str(Path(__file__).with_name("tiny_llama"))
BLOCK = 16
LAYERS = 2
KV_HEADS = 2
HEAD = 32
SAMPLED = 100  # the token every decode step "samples"
# Requests are added to the scheduler directly, past the engine's check of their length:
# a test must keep them within this.
MAX_MODEL_LEN = 2048


def kv_value(token: int, pos: int, layer: int, rank: int) -> float:
    """What the stand-in forward writes for one token (exact in float16)."""
    return float((token * 7 + pos * 3 + layer * 11 + rank * 5) % 997) / 8.0


@dataclass
class Rig:
    sched: Scheduler
    workers: list[Any]  # SparkCacheConnector, one per TP rank
    kv: list[dict[str, torch.Tensor]]
    tables: dict[str, list[int]] = field(default_factory=dict)  # the first group's
    # Every KV cache group's block ids, and the group of each layer (in the order of the
    # KV dicts): a hybrid rig has a full-attention and a sliding-window group.
    group_tables: dict[str, list[list[int]]] = field(default_factory=dict)
    layer_groups: list[int] = field(default_factory=list)
    sent: Counter = field(default_factory=Counter)
    recved: Counter = field(default_factory=Counter)
    load_errors: set[int] = field(default_factory=set)
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)  # failed by request (hybrid)
    loads: dict[str, list[int]] = field(default_factory=dict)  # request -> blocks loaded
    # The connector stats payloads vLLM's scheduler put in its SchedulerStats.
    stats: list[dict[str, Any]] = field(default_factory=list)
    steps: int = 0

    @property
    def tp(self) -> int:
        return len(self.workers)

    def step(self) -> Any:
        so = self.sched.schedule()
        starts = {}
        for nr in so.scheduled_new_reqs:
            self.group_tables[nr.req_id] = [list(ids) for ids in nr.block_ids]
            starts[nr.req_id] = nr.num_computed_tokens
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            if cr.new_block_ids[i] is not None:
                resumed = rid in getattr(cr, "resumed_req_ids", ())
                self.group_tables[rid] = [
                    list(new) if resumed else old + list(new)
                    for old, new in zip(self.group_tables[rid], cr.new_block_ids[i],
                                        strict=True)]
            starts[rid] = cr.num_computed_tokens[i]
        for rid in starts:
            self.tables[rid] = self.group_tables[rid][0]
        meta = so.kv_connector_metadata
        for job in getattr(meta, "loads", ()):
            self.loads[job.req_id] = list(job.block_ids)
        for w in self.workers:
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            if so.has_sync_kv_loads:
                w.start_load_kv(None)
        for rid, n in so.num_scheduled_tokens.items():
            self.forward(rid, starts[rid], n)
        sending: set[str] = set()
        recving: set[str] = set()
        errors: set[int] = set()
        failed: set[str] = set()
        worker_stats = None
        for w in self.workers:
            if not so.has_sync_kv_loads:
                w.start_load_kv(None)
            w.wait_for_save()
            results = w.get_transfer_results(so.finished_req_ids)
            s, r = results.finished_sending, results.finished_recving
            failed |= results.failed_recving
            errors |= w.get_block_ids_with_load_errors()
            st = w.get_kv_connector_stats()
            if st is not None:
                worker_stats = st if worker_stats is None else worker_stats.aggregate(st)
            w.clear_connector_metadata()
            self.sent.update(s or ())
            self.recved.update(r or ())
        for rid in list(self.sent):
            if self.sent[rid] >= self.tp:
                sending.add(rid)
                del self.sent[rid]
        for rid in list(self.recved):
            if self.recved[rid] >= self.tp:
                recving.add(rid)
                del self.recved[rid]
        self.load_errors |= errors
        self.finished_sending |= sending
        self.finished_recving |= recving
        self.failed_recving |= failed
        kvo = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                failed_recving=failed, invalid_block_ids=errors,
                                kv_connector_stats=worker_stats)
        ids = list(so.num_scheduled_tokens)
        outputs = self.sched.update_from_output(so, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            kv_connector_output=kvo,
            sampled_token_ids=[[] if self.sched.requests[r].is_prefill_chunk else [SAMPLED]
                               for r in ids]))
        for out in outputs.values():
            stats = getattr(out, "scheduler_stats", None)
            if stats is not None and stats.kv_connector_stats:
                self.stats.append(stats.kv_connector_stats)
        self.steps += 1
        return so

    def forward(self, rid: str, start: int, n: int) -> None:
        tokens = self.sched.requests[rid].all_token_ids
        for rank, kv in enumerate(self.kv):
            for li, t in enumerate(kv.values()):
                table = self.group_tables[rid][self.layer_groups[li] if self.layer_groups else 0]
                for pos in range(start, start + n):
                    t[table[pos // BLOCK], :, pos % BLOCK, :] = kv_value(tokens[pos], pos, li, rank)

    def block_holds(self, rank: int, block: int, tokens: list[int], first_pos: int,
                    group: int = 0) -> bool:
        """Does ``block`` of ``rank`` hold what the forward writes for ``tokens`` at
        positions ``first_pos...``, in the layers of KV cache group ``group``?"""
        for li, t in enumerate(self.kv[rank].values()):
            if self.layer_groups and self.layer_groups[li] != group:
                continue
            for j, tok in enumerate(tokens):
                got = t[block, :, j, :]
                want = kv_value(tok, first_pos + j, li, rank)
                if not torch.equal(got, torch.full_like(got, want)):
                    return False
        return True

    def run_until_idle(self, timeout: float = 60.0) -> None:
        """Step until no request is open. Bounded in time, not steps: a finished request
        stays open until capture has copied its blocks, which on a loaded host can take
        longer than any fixed number of these fast steps."""
        deadline = time.monotonic() + timeout
        steps = 0
        while self.sched.requests:
            if time.monotonic() > deadline:
                raise AssertionError(f"requests open after {timeout:g} s ({steps} steps): "
                                     f"{list(self.sched.requests)}")
            self.step()
            steps += 1

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
        # The scheduler's own shutdown: its KV event publisher's thread, then the connector.
        self.sched.shutdown()


def request(rid: str, prompt: list[int], max_tokens: int = 2, *,
            hash_fn: Callable[[Any], bytes] = sha256, **kw: Any) -> Request:
    """A request as vLLM's engine core makes it: its blocks hashed with ``hash_fn`` (the
    rig's ``hash_algo``; vLLM's default, SHA-256, unless a test says otherwise)."""
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.update_from_generation_config({}, 2)
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=sp,
                   pooling_params=None, block_hasher=get_request_block_hasher(BLOCK, hash_fn),
                   **kw)


@contextmanager
def rig(store: Path, instance: str, *, tp: int = 1, num_blocks: int = 128,
        extra: dict | None = None, max_batched: int = 256, hash_algo: str = "sha256",
        kv_events: KVEventsConfig | None = None, sliding_window: int | None = None,
        draft: bool = False):
    """A Scheduler and ``tp`` worker connectors on ``store``/``instance``, vLLM's
    ``prefix_caching_hash_algo`` set to ``hash_algo``, its KV events published as
    ``kv_events`` says (none unless given). ``NONE_HASH`` is made with SHA-256
    whatever that is: vLLM's xxhash needs a package this environment leaves out, so a
    test that names it gives its requests a hasher of its own. ``sliding_window``
    (tokens): a hybrid model, its first layer of full attention and its second of that
    sliding window, each a KV cache group of the hybrid allocator. ``draft``: the
    connectors are made as beside a draft model that drops its hits' last block."""
    os.environ.setdefault("VLLM_CACHE_ROOT", str(store.parent / "vllm-cache"))
    # No load is cut for recomputing faster (``load_cost``) unless a test says so: the
    # stand-in forward computes a step in milliseconds, and the tests' own pauses between
    # steps make loads look slow.
    settings = {"store_dir": str(store), "instance": instance, "model_id": "tiny-llama-test",
                "cut_slow_loads": False, **(extra or {})}
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=MODEL, dtype="float16", seed=0,
                                 skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_batched,
                                         max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False,
                                 prefix_caching_hash_algo=hash_algo),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        kv_transfer_config=KVTransferConfig(
            kv_connector="SparkCacheConnector", kv_connector_module_path="sparkcache.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config=settings),
        device_config=DeviceConfig("cpu"),
        kv_events_config=kv_events,
    )
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD,
                             dtype=torch.float16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    groups = [KVCacheGroupSpec(names, spec)]
    memory = num_blocks * spec.page_size_bytes * LAYERS
    if sliding_window is not None:
        window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD,
                                   dtype=torch.float16, sliding_window=sliding_window)
        groups = [KVCacheGroupSpec(names[:1], spec), KVCacheGroupSpec(names[1:], window)]
        memory = num_blocks * spec.page_size_bytes
    layout = resolve_kv_cache_layout(
        vllm_config, [[m.name for m in get_supported_kv_cache_layouts([])]],
        [g.kv_cache_spec for g in groups])
    kv_cache_config = get_kv_cache_config_from_groups(vllm_config, groups, memory)
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    # As vLLM's engine core resolves it before making the scheduler (and with it the
    # connector's scheduler side, whose key memo reads it).
    kv_cache_config.hash_block_size = BLOCK
    workers, kvs = [], []
    drafted = mock.patch.object(settings_mod, "eagle_block_drop", return_value=draft)
    try:
        drafted.start()
        # Workers first, as in vLLM: they register (and write the registry) before the
        # scheduler is made.
        for rank in range(tp):
            with mock.patch.object(connector_mod, "_tp_rank", return_value=rank):
                w = KVConnectorFactory.create_connector(
                    vllm_config, KVConnectorRole.WORKER, kv_cache_config)
            kv = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
            w.register_kv_caches(kv)
            workers.append(w)
            kvs.append(kv)
        init_none_hash(sha256)
        sched = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                          block_size=BLOCK,
                          structured_output_manager=StructuredOutputManager(vllm_config),
                          log_stats=True)
    except BaseException:
        for w in workers:
            w.shutdown()
        raise
    finally:
        drafted.stop()
    r = Rig(sched, workers, kvs,
            layer_groups=[0, 1] if sliding_window is not None else [])
    try:
        yield r
    finally:
        r.close()
