"""Two turns of one conversation through vLLM's OpenAI API, the way an agent sends them:
turn 2 (turn 1's prompt, its reply and new tokens) goes out the moment turn 1's reply is
in. Then turn 2 again under a cache salt of its own, which no cache has seen: a
recompute, to compare with. Prints each turn's time and cached prompt tokens, and
whether turn 2's reply equals the recompute's (tokens, and logprobs within 1e-3):

    python -m sparkcache.vllm.two_turns --port 8000

Prompts are token ids (below 500: any model has those), random for each run unless
``--seed`` is given, so a second run's turn 1 is not a hit of the first's. Exit code 0
when turn 2 hit (vLLM counted cached prompt tokens) and matched the recompute; the
server needs ``--enable-prompt-tokens-details`` for the count. Used by docs/vllm.md's
walkthrough."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

LOGPROB_TOLERANCE = 1e-3
FIRST_ID, LAST_ID = 3, 500  # token ids every model's vocabulary holds (0-2: special)


@dataclass(frozen=True)
class Turn:
    tokens: list[int]  # generated
    logprobs: list[float]
    cached: int  # prompt tokens vLLM did not compute (its cache or a connector's)
    seconds: float


class ServerError(RuntimeError):
    pass


def _request(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)
    except urllib.error.HTTPError as exc:
        raise ServerError(f"{url}: HTTP {exc.code}: {exc.read()[:500]!r}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ServerError(f"{url}: {exc}") from None


def model_of(base: str) -> str:
    """The first model the server serves."""
    return str(_request(f"{base}/v1/models")["data"][0]["id"])


def complete(base: str, model: str, prompt: list[int], max_tokens: int,
             salt: str | None = None) -> Turn:
    """A greedy completion of ``prompt``."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": 1, "ignore_eos": True, "return_token_ids": True,
            # Logprobs name tokens by id: no tokenizer needed (a model without one).
            "return_tokens_as_token_ids": True,
            **({"cache_salt": salt} if salt else {})}
    t0 = time.perf_counter()
    out = _request(f"{base}/v1/completions", body)
    seconds = time.perf_counter() - t0
    choice = out["choices"][0]
    details = out.get("usage", {}).get("prompt_tokens_details") or {}
    return Turn(list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"]),
                int(details.get("cached_tokens") or 0), seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sparkcache.vllm.two_turns",
        description="Two turns of a conversation through vLLM's OpenAI API, the second "
                    "sent at once, compared with a recompute.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", help="default: the first the server serves")
    parser.add_argument("--tokens", type=int, default=4096, help="turn 1's prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=64,
                        help="tokens turn 2 adds after turn 1's reply")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens each reply has")
    parser.add_argument("--seed", type=int, help="default: a new conversation each run")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.new_tokens < 1 or args.max_tokens < 1:
        parser.error("--tokens, --new-tokens and --max-tokens: at least 1 each")
    base = f"http://{args.host}:{args.port}"
    rng = random.Random(args.seed if args.seed is not None else os.urandom(8))
    prompt = [rng.randrange(FIRST_ID, LAST_ID) for _ in range(args.tokens)]
    try:
        model = args.model or model_of(base)
        first = complete(base, model, prompt, args.max_tokens)
        second_prompt = [*prompt, *first.tokens,
                         *(rng.randrange(FIRST_ID, LAST_ID) for _ in range(args.new_tokens))]
        second = complete(base, model, second_prompt, args.max_tokens)  # at once
        recompute = complete(base, model, second_prompt, args.max_tokens,
                             salt=os.urandom(8).hex())
    except ServerError as exc:
        print(f"sparkcache: {exc}", file=sys.stderr)
        return 1
    same = second.tokens == recompute.tokens
    drift = max((abs(a - b) for a, b in zip(second.logprobs, recompute.logprobs,
                                            strict=True)), default=0.0) if same else None
    matched = same and drift is not None and drift <= LOGPROB_TOLERANCE
    result = {
        "model": model, "turn1": {"prompt_tokens": len(prompt), "seconds": first.seconds,
                                  "cached_tokens": first.cached},
        "turn2": {"prompt_tokens": len(second_prompt), "seconds": second.seconds,
                  "cached_tokens": second.cached},
        "recompute": {"seconds": recompute.seconds, "cached_tokens": recompute.cached},
        "same_tokens": same, "max_logprob_difference": drift, "matched": matched,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"turn 1: {len(prompt)} prompt tokens in {first.seconds:.2f} s, "
              f"{first.cached} cached")
        print(f"turn 2, sent as turn 1's reply came: {len(second_prompt)} prompt tokens in "
              f"{second.seconds:.2f} s, {second.cached} cached")
        print(f"turn 2 recomputed (a cache salt of its own): {recompute.seconds:.2f} s, "
              f"{recompute.cached} cached")
        print(f"turn 2's reply equals the recompute's: {'yes' if matched else 'NO'} "
              f"(tokens {'equal' if same else 'differ'}"
              + (f", logprobs within {drift:.1e})" if drift is not None else ")"))
    if not second.cached:
        print("sparkcache: turn 2 had no cached tokens: see the connector's lines in vLLM's "
              "log ('SparkCache rank 0 ...') and `sparkcache status`", file=sys.stderr)
        return 1
    return 0 if matched else 1


if __name__ == "__main__":
    sys.exit(main())
