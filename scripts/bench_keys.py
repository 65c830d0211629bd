"""Page keys of a 300k-token vLLM request, on the scheduler side, measured in one run.

Requests are vLLM's own ``Request`` objects with vLLM's block hasher (SHA-256, block size
= page size), as the engine core makes them when a KV connector is configured, and keys
are derived from those hashes as the connector derives them then
(``sparkcache.vllm.block_hash_keys``).

* ``sequence_keys_ms_300k``: from-scratch ``identity.sequence_keys`` of the 300k tokens,
  the baseline.
* ``keys_ms_300k_cold``: ``RequestKeys`` of the request seen for the first time, with
  the memo remembering another 300k-token conversation, as on a serving scheduler: every
  page's vLLM hash is looked up there and misses (``..._no_memo``: memo off). Budget: 5 ms.
  ``keys_ms_300k_cold_from_tokens``: the same, hashed from the tokens, as the connector
  does where vLLM's hash is not cryptographic (``--prefix-caching-hash-algo xxhash``;
  no memo there).
* ``keys_ms_300k``: the next turn of a conversation: the previous request (the first
  300k - 2k tokens) remembered, 2k new tokens. Budget: 5 ms.
* ``keys_us_step``: ``update`` after a decode step added one token to the running 300k
  request (median over steps that complete no page; ``keys_us_step_page``: those that
  complete one). ``keys_ms_step`` is the same median in ms.
* ``memo_bytes_per_page``: memory the memo keeps per remembered page (tracemalloc, the
  request and its RequestKeys gone), and ``vllm_block_hashes_ms_300k``: vLLM's own
  time to make the request with its block hashes, for scale.

Each figure is the median of ``--runs`` runs. Needs vLLM (the scheduler venv):
``.vllm/sched/bin/python scripts/bench_keys.py [--json]``
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sparkcache.identity import Namespace, sequence_keys
from sparkcache.vllm.request_keys import KeyMemo, RequestKeys


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--tokens", type=int, default=300_000)
    parser.add_argument("--new", type=int, default=2_000, help="new tokens of the next turn")
    parser.add_argument("--page-tokens", type=int, default=16)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=256, help="decode steps timed")
    args = parser.parse_args()

    import vllm
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    step = args.page_tokens
    init_none_hash(sha256)
    hasher = get_request_block_hasher(step, sha256)
    sampling = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    sampling.update_from_generation_config({}, 2)

    def request(rid: str, tokens: list[int]) -> Request:
        return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=sampling,
                       pooling_params=None, block_hasher=hasher)

    rnd = random.Random(0)
    tokens = [rnd.randrange(150_000) for _ in range(args.tokens)]
    ns = Namespace("bench-model", "bfloat16", "vllm/v1:L80:H1:D128:B16:mha:LBHNC", 8, 0, step)

    def request_keys(req: Request, memo: KeyMemo | None) -> RequestKeys:
        return RequestKeys(ns, req, hash_block_size=step, memo=memo, block_hash_algo="sha256")

    vllm_ms, baseline, cold, cold_off, cold_tokens, warm = [], [], [], [], [], []
    prev = request("prev", tokens[: args.tokens - args.new])
    other = request("other", [rnd.randrange(150_000) for _ in range(args.tokens)])
    for _ in range(args.runs):
        t0 = time.perf_counter()
        cur = request("cur", tokens)
        vllm_ms.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        want = sequence_keys(ns, tokens).pages
        baseline.append(time.perf_counter() - t0)

        memo = KeyMemo()
        request_keys(other, memo)
        t0 = time.perf_counter()
        keys = request_keys(cur, memo)
        cold.append(time.perf_counter() - t0)
        assert keys.memo_pages == 0
        derived = list(keys.keys)
        assert len(derived) == len(want)

        t0 = time.perf_counter()
        request_keys(cur, None)
        cold_off.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        from_tokens = RequestKeys(ns, cur, memo=None)
        cold_tokens.append(time.perf_counter() - t0)
        assert from_tokens.keys == list(want)

        memo = KeyMemo()
        request_keys(prev, memo)  # the previous turn
        t0 = time.perf_counter()
        keys = request_keys(cur, memo)
        warm.append(time.perf_counter() - t0)
        assert list(keys.keys) == derived
        taken, hashed = keys.memo_pages, keys.hashed_pages

    # Decode steps on the running request (its RequestKeys from the last warm run).
    plain, page = [], []
    for _ in range(args.steps):
        cur.append_output_token_ids(rnd.randrange(150_000))  # vLLM's part, not timed
        t0 = time.perf_counter()
        keys.update(cur)
        took = time.perf_counter() - t0
        (page if cur.num_tokens % step == 0 else plain).append(took)
    assert list(keys.keys) == list(request_keys(cur, None).keys)

    # Memory the memo keeps per remembered page: everything else dropped.
    del cur, keys, memo, prev
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    memo = KeyMemo()
    req = request("mem", tokens)
    request_keys(req, memo)
    del req
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    per_page = held / memo.pages

    med = statistics.median
    result = {
        "tokens": args.tokens, "page_tokens": step, "pages": args.tokens // step,
        "new_tokens": args.new, "runs": args.runs,
        "sequence_keys_ms_300k": _ms(med(baseline)),
        "keys_ms_300k_cold": _ms(med(cold)),
        "keys_ms_300k_cold_no_memo": _ms(med(cold_off)),
        "keys_ms_300k_cold_from_tokens": _ms(med(cold_tokens)),
        "keys_ms_300k": _ms(med(warm)),
        "keys_ms_300k_max": _ms(max(warm)),
        "speedup_vs_sequence_keys": round(med(baseline) / med(warm), 1),
        "memo_pages_taken": taken, "pages_hashed": hashed,
        "keys_ms_step": round(med(plain) * 1e3, 5),
        "keys_us_step": round(med(plain) * 1e6, 2),
        "keys_us_step_page": round(med(page) * 1e6, 2) if page else None,
        "memo_bytes_per_page": round(per_page, 1),
        "memo_mb_default_bound": round(per_page * KeyMemo().max_pages / 1e6, 1),
        "vllm_block_hashes_ms_300k": _ms(med(vllm_ms)),
        "vllm": vllm.__version__, "python": sys.version.split()[0],
    }
    if args.json:
        print(json.dumps(result))
        return
    for name, value in result.items():
        print(f"{name:28} {value}")


if __name__ == "__main__":
    main()
