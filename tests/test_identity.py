"""Page identity: chained, namespaced, domain-separated keys."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkcache.identity import (
    FORMAT_VERSION,
    KeyChain,
    KeyExtras,
    Namespace,
    chain_seed,
    require_hex,
    sequence_keys,
)
from sparkcache.kvmem import BlockViews, page_layout

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
        {"tp_size": 8},
        {"page_tokens": 32},
        {"format_version": FORMAT_VERSION + 1},
    ],
)
def test_every_namespace_field_but_rank_changes_every_key(change: dict[str, object]) -> None:
    other = dataclasses.replace(NS, **change)
    a, b = sequence_keys(NS, TOKENS), sequence_keys(other, TOKENS)
    assert not set(a.all()) & set(b.all())


def test_rank_does_not_change_the_keys() -> None:
    """Each rank stores in its own directory (rank-<r>/), so a key never meets another
    rank's page, and what differs between ranks' bytes (the heads each holds) is fixed by
    tp_size and kv_layout: the rank is left out so that the scheduler computes one chain
    for every TP rank. Namespaces that differ only in rank are equal."""
    others = [dataclasses.replace(NS, rank=r) for r in range(NS.tp_size)]
    assert {ns.seed() for ns in others} == {NS.seed()}
    assert all(ns == NS and hash(ns) == hash(NS) for ns in others)
    assert {sequence_keys(ns, TOKENS) for ns in others} == {sequence_keys(NS, TOKENS)}


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


def test_model_id_must_be_given() -> None:
    for bad in ("", "  "):
        with pytest.raises(ValueError, match=r"model_id .* non-empty string: the model's"):
            dataclasses.replace(NS, model_id=bad)


def _layers(blocks: int, n: int = 3, shape: tuple[int, ...] = (2, 16, 4, 64),
            dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """``n`` vLLM-style [K/V, blocks, block size, heads, head size] layer tensors."""
    return [torch.empty((shape[0], blocks, *shape[1:]), dtype=dtype) for _ in range(n)]


def test_page_layout_ignores_the_block_count() -> None:
    """vLLM sizes the number of blocks by profiling at every start: the layout (and so
    every key) must not change with it."""
    small, large = page_layout(_layers(64), 1), page_layout(_layers(9000), 1)
    assert small == large
    assert BlockViews(_layers(10), 1).page_layout() == small
    # Strides (the backend's physical order) do not change a page's bytes either.
    strided = [t.transpose(3, 4).contiguous().transpose(3, 4) for t in _layers(64)]
    assert page_layout(strided, 1) == small
    keys = [sequence_keys(dataclasses.replace(NS, kv_layout=page_layout(_layers(b), 1)), TOKENS)
            for b in (64, 9000)]
    assert keys[0] == keys[1]


@pytest.mark.parametrize(
    "other",
    [
        {"n": 4},  # layers
        {"shape": (1, 16, 4, 64)},  # K/V together
        {"shape": (2, 16, 8, 64)},  # heads
        {"shape": (2, 16, 4, 128)},  # head size
        {"shape": (2, 32, 4, 64)},  # page tokens
        {"dtype": torch.float16},
    ],
)
def test_page_layout_changes_with_what_fixes_a_pages_bytes(other: dict) -> None:
    assert page_layout(_layers(64, **other), 1) != page_layout(_layers(64), 1)


SALTED = [
    KeyExtras(adapter="a"),
    KeyExtras(cache_salt="a"),
    KeyExtras(mm_hashes=("a",)),
    KeyExtras(adapter=""),
    KeyExtras(cache_salt=""),
    KeyExtras(mm_hashes=("",)),
    KeyExtras(mm_hashes=("ab", "c")),
    KeyExtras(mm_hashes=("a", "bc")),
    KeyExtras(mm_hashes=("c", "ab")),
    KeyExtras(adapter="a", cache_salt="b"),
    KeyExtras(adapter="b", cache_salt="a"),
    KeyExtras(adapter="a", mm_hashes=("a",), cache_salt="a"),
]


def test_no_extras_keep_a_plain_requests_keys() -> None:
    plain = sequence_keys(NS, TOKENS)
    assert sequence_keys(NS, TOKENS, None) == plain
    assert sequence_keys(NS, TOKENS, KeyExtras()) == plain
    assert chain_seed(NS, KeyExtras(mm_hashes=[])) == NS.seed()


def test_extras_change_every_key_and_never_collide_across_kinds() -> None:
    """Salt "a", adapter "a" and image hash "a" are different requests; so are an empty
    salt and no salt, and hash lists whose joined text is the same."""
    plain = set(sequence_keys(NS, TOKENS).all())
    seeds = {chain_seed(NS, extra) for extra in SALTED}
    assert len(seeds) == len(SALTED) and NS.seed() not in seeds
    seen: set[str] = set()
    for extra in SALTED:
        keys = set(sequence_keys(NS, TOKENS, extra).all())
        assert len(keys) == 6 and not keys & plain and not keys & seen, extra
        seen |= keys
        assert sequence_keys(NS, TOKENS, extra) == sequence_keys(
            NS, TOKENS, dataclasses.replace(extra)
        )


def test_bad_extras_rejected() -> None:
    with pytest.raises(ValueError, match="mm_hashes"):
        KeyExtras(mm_hashes="abc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mm_hashes"):
        KeyExtras(mm_hashes=(b"ab",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cache_salt"):
        KeyExtras(cache_salt=7)  # type: ignore[arg-type]


# ---------------------------------------------------------------- formula, per-page extras


def _reference_keys(seed: bytes, tokens: list[int], step: int) -> list[str]:
    """The documented formula, written out: h_i = blake2b-128(person=b"sparkcache-page",
    h_{i-1} || u64le(n) || int64le tokens)."""
    keys, prev = [], seed
    for i in range(len(tokens) // step):
        page = np.asarray(tokens[i * step : (i + 1) * step], dtype="<i8")
        prev = hashlib.blake2b(
            prev + struct.pack("<Q", step) + page.tobytes(),
            digest_size=16, person=b"sparkcache-page",
        ).digest()
        keys.append(prev.hex())
    return keys


def test_plain_keys_follow_the_documented_formula() -> None:
    """A plain request's page keys are what they were before per-page extras (only the
    seed changed, with the rank); empty page extras are no extras."""
    ref = _reference_keys(NS.seed(), TOKENS, 16)
    assert list(sequence_keys(NS, TOKENS).pages) == ref
    assert sequence_keys(NS, TOKENS, page_extras={}) == sequence_keys(NS, TOKENS)
    assert sequence_keys(NS, TOKENS, page_extras={2: (), 9: []}) == sequence_keys(NS, TOKENS)


def test_page_extras_change_their_page_and_what_follows_only() -> None:
    plain = sequence_keys(NS, TOKENS)
    marked = sequence_keys(NS, TOKENS, page_extras={2: ("img-1",)})
    assert marked.pages[:2] == plain.pages[:2]
    assert not set(marked.all()[2:]) & set(plain.all())
    # A later page's extras leave earlier pages alone, and differ from earlier ones.
    later = sequence_keys(NS, TOKENS, page_extras={3: ("img-1",)})
    assert later.pages[:3] == plain.pages[:3] and later.pages[3] != plain.pages[3]
    assert not set(later.all()[3:]) & set(marked.all())
    # The tail has extras of its own page index.
    tail = sequence_keys(NS, TOKENS, page_extras={5: ("img-1",)})
    assert tail.pages == plain.pages and tail.tail != plain.tail


PAGE_EXTRAS = [
    ("a",), ("",), ("ab", "c"), ("a", "bc"), ("c", "ab"), ("a", "a"), ("a", ""), ("", "a"),
]


def test_page_extras_are_length_prefixed_and_domain_separated() -> None:
    """Different value lists never give the same key; nor does page extras "a" and a
    request-wide extra "a" of any kind."""
    seen: set[str] = set(sequence_keys(NS, TOKENS).all())
    for values in PAGE_EXTRAS:
        keys = set(sequence_keys(NS, TOKENS, page_extras={0: values}).all())
        assert len(keys) == 6 and not keys & seen, values
        seen |= keys
    for extra in (KeyExtras(adapter="a"), KeyExtras(cache_salt="a"),
                  KeyExtras(mm_hashes=("a",))):
        keys = set(sequence_keys(NS, TOKENS, extra).all())
        assert not keys & seen
        both = set(sequence_keys(NS, TOKENS, extra, page_extras={0: ("a",)}).all())
        assert not both & seen and not both & keys


def test_extras_page_never_equals_a_plain_page_or_tail() -> None:
    """The extras variants have their own person tags: a page with extras () cannot be
    forged as a page whose tokens spell out the extras' encoding."""
    ns = dataclasses.replace(NS, page_tokens=4)
    with_extras = sequence_keys(ns, [1, 2, 3, 4, 5], page_extras={0: ("x",), 1: ("x",)})
    plain = sequence_keys(ns, [1, 2, 3, 4, 5])
    assert not set(with_extras.all()) & set(plain.all())
    tail_only = sequence_keys(dataclasses.replace(NS, page_tokens=5), [1, 2, 3, 4],
                              page_extras={0: ("x",)})
    assert tail_only.tail not in with_extras.all()


@pytest.mark.parametrize(
    "bad",
    [{-1: ("a",)}, {"0": ("a",)}, {True: ("a",)}, {0: "ab"}, {0: (b"a",)}, {0: (1,)}],
)
def test_bad_page_extras_rejected(bad: dict) -> None:
    with pytest.raises(ValueError, match="page_extras"):
        sequence_keys(NS, TOKENS, page_extras=bad)


# ---------------------------------------------------------------- incremental chain


def test_key_chain_extends_incrementally() -> None:
    chain = KeyChain(NS)
    live = chain.keys
    assert chain.extend(TOKENS[:10]) == 0 and len(chain) == 0
    assert chain.tail_key() == sequence_keys(NS, TOKENS[:10]).tail
    assert chain.extend(TOKENS[10:40]) == 2 and chain.num_tokens == 40
    assert chain.keys is live and live == list(sequence_keys(NS, TOKENS[:40]).pages)
    chain.extend(np.asarray(TOKENS[40:], dtype=np.int32))
    assert chain.pages() == sequence_keys(NS, TOKENS).pages
    assert chain.tail_key() == sequence_keys(NS, TOKENS).tail
    assert chain.state == bytes.fromhex(chain.keys[-1])
    assert KeyChain(NS).state == NS.seed()


def test_key_chain_page_extras_rules() -> None:
    want = sequence_keys(NS, TOKENS, KeyExtras(cache_salt="s"), page_extras={1: ("i",)})
    chain = KeyChain(NS, KeyExtras(cache_salt="s"))
    chain.extend(TOKENS[:20], page_extras={1: ("old",)})
    chain.extend(TOKENS[20:30], page_extras={1: ("i",)})  # replaces: page 1 not full yet
    chain.extend(TOKENS[30:])
    assert chain.pages() == want.pages and chain.tail_key() == want.tail
    with pytest.raises(ValueError, match=r"page\(s\) \[1\] already hashed"):
        chain.extend([], page_extras={1: ("i",)})


def test_key_chain_adopts_a_known_prefix() -> None:
    full = sequence_keys(NS, TOKENS).pages
    chain = KeyChain(NS)
    chain.extend(TOKENS[:16])
    chain.adopt(full, 3)
    assert chain.keys == list(full[:3])
    chain.extend(TOKENS[48:])
    assert chain.pages() == full and chain.tail_key() == sequence_keys(NS, TOKENS).tail
    chain.adopt(full[:2])  # nothing new: no-op
    with pytest.raises(ValueError, match="count 9 out of range"):
        chain.adopt(full, 9)
    other = KeyChain(NS)
    other.extend(TOKENS[16:32])
    with pytest.raises(ValueError, match="page 0 differs"):
        other.adopt(full[:3])
    waiting = KeyChain(NS)
    waiting.extend(TOKENS[:3])
    with pytest.raises(ValueError, match="waiting"):
        waiting.adopt(full[:2])


@st.composite
def _chunked(draw: st.DrawFn) -> tuple[int, list[int], list[int], dict[int, tuple[str, ...]]]:
    step = draw(st.integers(1, 6))
    tokens = draw(st.lists(st.integers(-(2**40), 2**40), max_size=60))
    cuts = sorted(draw(st.lists(st.integers(0, len(tokens)), max_size=8)))
    pages = len(tokens) // step + 1
    extras = draw(st.dictionaries(st.integers(0, pages), st.lists(st.text(max_size=3),
                                                                  max_size=2).map(tuple)))
    return step, tokens, cuts, extras


@settings(max_examples=300, deadline=None)
@given(_chunked(), st.randoms(use_true_random=False))
def test_key_chain_in_any_chunks_equals_sequence_keys(case: tuple, rnd) -> None:
    """Extending in arbitrary chunks, each page's extras given with a random call up to
    the one that fills it, gives exactly the keys of the whole sequence."""
    step, tokens, cuts, extras = case
    ns = dataclasses.replace(NS, page_tokens=step)
    bounds = [0, *cuts, len(tokens)]
    calls: list[dict[int, tuple[str, ...]]] = [{} for _ in range(len(bounds) - 1)]
    for page, values in extras.items():
        # The call that fills the page (or the last call, for the tail and beyond).
        filling = next((c for c in range(len(calls)) if bounds[c + 1] >= (page + 1) * step),
                       len(calls) - 1)
        calls[rnd.randint(0, filling)][page] = values
    chain = KeyChain(ns, KeyExtras(adapter="lora"))
    for c in range(len(calls)):
        chain.extend(tokens[bounds[c] : bounds[c + 1]], page_extras=calls[c])
    want = sequence_keys(ns, tokens, KeyExtras(adapter="lora"), page_extras=extras)
    assert chain.pages() == want.pages
    assert chain.tail_key() == want.tail
    assert chain.num_tokens == len(tokens)


def test_keys_as_bytes_are_the_halves_of_their_hex() -> None:
    from sparkcache.identity import key_halves, keys_bytes, split_keys

    keys = [f"{i:032x}" for i in (1, 2**64, 2**128 - 1)]
    raw = keys_bytes(keys)
    assert raw == bytes.fromhex("".join(keys))
    assert (key_halves(raw) == split_keys(keys)).all() and key_halves(raw).shape == (3, 2)
    assert (key_halves(keys) == split_keys(keys)).all()
    assert key_halves(b"").shape == (0, 2)
    with pytest.raises(ValueError, match="multiple of 16 bytes, got 17"):
        key_halves(raw[:17])
    with pytest.raises(ValueError, match="page key"):
        keys_bytes(["AB" * 16])


def test_join_keys_is_join_key_per_pair() -> None:
    from sparkcache.shm.layouts import join_key, join_keys, split_key

    keys = [f"{i:032x}" for i in (0, 1, 2**64, 2**128 - 1)] + [os.urandom(16).hex()]
    halves = np.array([split_key(k) for k in keys], np.uint64)
    assert join_keys(halves[:, 0], halves[:, 1]) == [join_key(*map(int, h)) for h in halves]
    assert join_keys(halves[:, 0], halves[:, 1]) == keys
    assert join_keys(halves[:0, 0], halves[:0, 1]) == []


def test_page_runs_are_the_blocks_bytes_in_page_order_and_write_into_it() -> None:
    """A restore reads a page straight into these views: they must be the block's runs,
    in the order ``gather`` lays the page out, and nothing of its neighbours."""
    layers = _layers(10, n=2)
    for t in layers:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                                dtype=torch.uint8))
    views = BlockViews(layers, 1)
    page = np.empty(views.page_bytes, np.uint8)
    for block in (0, 4, 9):
        runs = views.page_runs(block)
        views.gather(block, page)
        assert b"".join(bytes(r) for r in runs) == page.tobytes()
        assert [r.nbytes for r in runs] == views.run_bytes
    before = [t.clone() for t in layers]
    for r in views.page_runs(4):
        r[:] = b"\xab" * r.nbytes
    views.gather(4, page)
    assert (page == 0xAB).all()
    for t, old in zip(layers, before, strict=True):
        changed = (t.view(torch.uint8) != old.view(torch.uint8)).nonzero()[:, 1].unique()
        assert changed.tolist() == [4]  # only block 4's bytes


def test_split_keys_is_split_key_per_key_and_names_a_bad_one() -> None:
    from sparkcache.shm.layouts import split_key

    from sparkcache.identity import split_keys

    keys = [f"{i:032x}" for i in (1, 2**64, 2**128 - 1)]
    assert [tuple(map(int, h)) for h in split_keys(keys)] == [split_key(k) for k in keys]
    assert split_keys([]).shape == (0, 2)
    for bad in ("AB" * 16, "ab" * 15, "ab" * 17, "zz" * 16, "ab" * 15 + " a", None):
        with pytest.raises(ValueError, match=f"page key {bad!r}"):
            split_keys([keys[0], bad])
    with pytest.raises(ValueError):  # lengths that add up, one short, one long
        split_keys(["ab" * 15, "ab" * 17])
