"""The connector's settings: SparkCache's own (``SPARKCACHE_*`` variables, then the
entries of ``kv_connector_extra_config`` named like ``Config`` fields), the model's
identity, and the staging pool's size."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

from sparkcache import config
from sparkcache.config import Config
from sparkcache.vllm.request_keys import kv_format, model_identity

log = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 256 << 20
# A running request's pages are published each time this many more are computed (1024
# tokens at vLLM's default 16-token block): a publication costs capture a pass over its
# records and commit a transaction, so not every step; a 300k-token prefill in 8k-token
# chunks still goes out chunk by chunk.
DEFAULT_SAVE_STRIDE_PAGES = 64
# Keys of kv_connector_extra_config that are the connector's own, not Config fields.
OWN_KEYS = ("model_id", "staging_bytes", "save_stride_pages", "cut_slow_loads",
            "save_wait_seconds")
# A request whose prefix a save of this engine is still storing waits for it at most this
# long (or as long as computing the pages it adds, if less): an agent's next turn comes
# within milliseconds of the last reply, before that reply's save is durable.
DEFAULT_SAVE_WAIT_S = 2.0
MAX_SAVE_WAIT_S = 60.0


@dataclass(frozen=True)
class Settings:
    cfg: Config
    model_id: str
    tp_size: int
    block_size: int
    staging_bytes: int
    save_stride_pages: int  # 0: a request is saved only when it finishes or is preempted
    # The KV format where the tensors' dtype does not name it (fp8 / fp4 caches are all
    # uint8): part of the namespace, so engines of different formats never share a page.
    kv_dtype: str | None = None
    # A hit's last page is not loaded, where vLLM's own prefix cache drops its last block
    # for the same reason (``eagle_block_drop``).
    drop_last_page: bool = False
    # A load expected to take longer than recomputing its tokens is not made
    # (``load_cost``). Off: every hit is loaded, however long it waits, and the engine's
    # time goes to other requests.
    cut_slow_loads: bool = True
    # How long a lookup may wait for a save of this engine still storing the prefix
    # (``scheduler_side``); 0: never, the prefix stored so far is taken.
    save_wait_s: float = DEFAULT_SAVE_WAIT_S


def eagle_block_drop(vllm_config: Any) -> bool:
    """Whether vLLM drops the last block of its own prefix-cache hits for the draft model
    (EAGLE, MTP): the draft layers' KV at a block's last token was computed with the token
    after it, which a new request may not share. Never where vLLM's block hashes cover
    that token (``num_hash_lookahead_tokens``: SparkCache's page keys then cover it too).
    vLLM 0.32 has no ``use_eagle_block_drop``: there every EAGLE method drops."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or getattr(vllm_config, "num_hash_lookahead_tokens", 0):
        return False
    drop = getattr(spec, "use_eagle_block_drop", None) or getattr(spec, "use_eagle", None)
    return bool(drop()) if callable(drop) else False


def from_vllm(vllm_config: Any) -> Settings:
    """Settings for ``vllm_config``; ValueError naming what is wrong."""
    extra: dict[str, Any] = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    unknown = sorted(set(extra) - set(config.FIELDS) - set(OWN_KEYS))
    if unknown:
        raise ValueError(
            f"kv_connector_extra_config: unknown key(s) {unknown}; allowed: "
            f"{sorted(config.FIELDS) + sorted(OWN_KEYS)}"
        )
    refused = _unsupported_parallelism(vllm_config.parallel_config)
    if refused is not None:
        raise ValueError(refused)
    block_size = int(vllm_config.cache_config.block_size)
    overrides = {k: str(v) for k, v in extra.items() if k in config.FIELDS}
    asked = overrides.get("page_tokens") or os.environ.get(config.env_name("page_tokens"))
    if asked is not None and asked.strip() != str(block_size):
        log.warning("SparkCache: page_tokens %s ignored: a page is one vLLM block, %d tokens "
                    "here (--block-size)", asked.strip(), block_size)
    # A page is one vLLM block: the keys the scheduler computes per block are page keys.
    overrides["page_tokens"] = str(block_size)
    cfg = config.load(overrides=overrides, check_store_dir=False)
    model = vllm_config.model_config
    model_id = extra.get("model_id") or (
        f"{model.model}@{model.revision}" if getattr(model, "revision", None) else model.model
    )
    # Quantized weights or other RoPE settings make other KV of the same checkpoint.
    model_id = model_identity(str(model_id), model)
    try:
        staging = int(extra.get("staging_bytes", DEFAULT_STAGING_BYTES))
    except (TypeError, ValueError):
        staging = -1
    if staging <= 0:
        raise ValueError(f"staging_bytes {extra.get('staging_bytes')!r}: a positive integer "
                         f"(bytes of shared memory per rank for an engine on the CPU)")
    stride = _non_negative(extra.get("save_stride_pages", DEFAULT_SAVE_STRIDE_PAGES))
    if stride < 0:
        raise ValueError(f"save_stride_pages {extra.get('save_stride_pages')!r}: a "
                         f"non-negative integer (pages computed between saves of a running "
                         f"request; 0: saved only when it finishes or is preempted)")
    cut = extra.get("cut_slow_loads", True)
    if not isinstance(cut, bool):
        raise ValueError(f"cut_slow_loads {cut!r}: true or false (whether a load expected "
                         f"to take longer than recomputing its tokens is left out)")
    wait = _seconds(extra.get("save_wait_seconds", DEFAULT_SAVE_WAIT_S))
    if not 0 <= wait <= MAX_SAVE_WAIT_S:  # (nan too)
        raise ValueError(f"save_wait_seconds {extra.get('save_wait_seconds')!r}: seconds "
                         f"from 0 to {MAX_SAVE_WAIT_S:g} (how long a request waits for a "
                         f"save of its prefix still being stored; 0: never)")
    return Settings(cfg, model_id, int(vllm_config.parallel_config.tensor_parallel_size),
                    block_size, staging, stride, kv_format(vllm_config),
                    eagle_block_drop(vllm_config), cut, wait)


# Parallelism whose ranks would share a tensor-parallel rank's registration on one node:
# a second pipeline stage or data-parallel engine registers rank r again, overwriting the
# first's (never served after, nothing logged), and context parallelism splits a block's
# tokens across ranks that publish and load them as whole pages.
_UNSUPPORTED_PARALLELISM = (
    ("pipeline_parallel_size", "pipeline parallelism"),
    ("data_parallel_size_local", "several data-parallel engines on one node"),
    ("decode_context_parallel_size", "decode context parallelism"),
    ("prefill_context_parallel_size", "prefill context parallelism"),
)


def _unsupported_parallelism(parallel: Any) -> str | None:
    """Why SparkCache cannot serve ``parallel`` (vLLM's ParallelConfig), or None."""
    for name, what in _UNSUPPORTED_PARALLELISM:
        size = int(getattr(parallel, name, 1) or 1)
        if size > 1:
            return (f"{what} ({name}={size}) is not supported: a rank's pages and "
                    f"registration are keyed by its tensor-parallel rank alone; supported: "
                    f"tensor parallelism, {name}=1 (data-parallel engines on separate "
                    f"nodes each with their own store are fine)")
    return None


def _seconds(value: Any) -> float:
    """``value`` (a number, or its text) as seconds, or nan."""
    if isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _non_negative(value: Any) -> int:
    """``value`` as an integer >= 0, or -1."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        return -1
    return n if n >= 0 and str(n) == str(value).strip() else -1
