"""Page identity: chained, namespaced, domain-separated keys."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sparkcache.identity import Namespace, require_hex, sequence_keys

NS = Namespace("llama-3-70b", "bfloat16", "nhd-2x", tp_size=4, rank=1, page_tokens=16)
TOKENS = list(range(1000, 1000 + 16 * 5 + 7))


def test_keys_are_deterministic_hex_and_tail_separate() -> None:
    keys = sequence_keys(NS, TOKENS)
    assert keys == sequence_keys(NS, TOKENS)
    assert len(keys.pages) == 5 and keys.tail is not None
    for k in keys.all():
        assert require_hex(k, "key") == k
    assert len(set(keys.all())) == 6


def test_chain_shares_prefix_and_diverges_after_a_change() -> None:
    a = sequence_keys(NS, TOKENS)
    changed = TOKENS.copy()
    changed[16 * 2 + 3] += 1
    b = sequence_keys(NS, changed)
    assert a.pages[:2] == b.pages[:2]
    assert all(x != y for x, y in zip(a.pages[2:], b.pages[2:], strict=True))
    # Same page tokens after a different prefix give a different key (chaining).
    assert sequence_keys(NS, TOKENS[16:32]).pages[0] != a.pages[1]


def test_tail_never_equals_a_full_page_key() -> None:
    ns = dataclasses.replace(NS, page_tokens=4)
    full = sequence_keys(ns, [1, 2, 3, 4])
    tail = sequence_keys(dataclasses.replace(NS, page_tokens=5), [1, 2, 3, 4])
    assert full.tail is None and tail.pages == ()
    assert full.pages[0] != tail.tail


def test_numpy_and_list_tokens_agree() -> None:
    ref = sequence_keys(NS, TOKENS)
    assert sequence_keys(NS, np.array(TOKENS, dtype=np.int32)) == ref
    assert sequence_keys(NS, np.array(TOKENS, dtype=np.int64)) == ref


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "llama-3-8b"},
        {"dtype": "float16"},
        {"kv_layout": "hnd-2x"},
        {"rank": 2},
        {"tp_size": 8},
        {"page_tokens": 32},
        {"format_version": 2},
    ],
)
def test_every_namespace_field_changes_every_key(change: dict[str, object]) -> None:
    other = dataclasses.replace(NS, **change)
    a, b = sequence_keys(NS, TOKENS), sequence_keys(other, TOKENS)
    assert not set(a.all()) & set(b.all())


def test_field_boundaries_cannot_shift() -> None:
    a = dataclasses.replace(NS, model_id="ab", dtype="c")
    b = dataclasses.replace(NS, model_id="a", dtype="bc")
    assert a.seed() != b.seed()


@pytest.mark.parametrize("bad", ["XYZ", "../" + "0" * 29, "0" * 31, "A" * 32, 7, None])
def test_require_hex_rejects_with_a_clear_message(bad: object) -> None:
    with pytest.raises(ValueError, match="is not a hex digest: expected 32 lowercase hex"):
        require_hex(bad, "page key")


def test_bad_namespace_and_tokens_rejected() -> None:
    with pytest.raises(ValueError, match="rank"):
        dataclasses.replace(NS, rank=4)
    with pytest.raises(ValueError, match="page_tokens"):
        dataclasses.replace(NS, page_tokens=0)
    with pytest.raises(ValueError, match="1-D sequence of integers"):
        sequence_keys(NS, np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="1-D sequence of integers"):
        sequence_keys(NS, [0.5, 1.5])
