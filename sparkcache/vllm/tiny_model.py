"""A small Llama with random weights, made offline, to try SparkCache beside vLLM where
no model can be downloaded (docs/vllm.md, "Walkthrough on a CPU host"):

    python -m sparkcache.vllm.tiny_model /tmp/tiny-llama

Four layers of 512, eight KV heads of 64, float32: 16 KiB of KV a token, 512 KiB a page
of 32 tokens; large enough that vLLM's CPU engine takes seconds to recompute a prefix of
a few thousand tokens, so a restore shows. It has no tokenizer: give vLLM
``--skip-tokenizer-init`` and prompts as token ids (``sparkcache.vllm.two_turns`` does).
Its replies are noise, but the same noise for the same KV: a restore that serves wrong
KV changes them. Needs ``transformers`` (vLLM installs it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

CONFIG = {
    "model_type": "llama", "hidden_size": 512, "intermediate_size": 1024,
    "num_attention_heads": 8, "num_key_value_heads": 8, "num_hidden_layers": 4,
    "head_dim": 64, "vocab_size": 1024, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}
# Weights large enough that attention depends on the KV it reads (transformers' default,
# 0.02, leaves a random model's output almost the same whatever the KV).
INITIALIZER_RANGE = 0.1


def write(path: Path, seed: int = 0) -> Path:
    """Write the model's config and weights (safetensors) into ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**CONFIG, initializer_range=INITIALIZER_RANGE)) \
        .save_pretrained(path, safe_serialization=True)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sparkcache.vllm.tiny_model",
        description="Write a small random Llama for trying SparkCache beside vLLM offline.")
    parser.add_argument("dir", type=Path, help="where to write it (created)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        write(args.dir, args.seed)
    except ImportError as exc:
        print(f"sparkcache: {exc}: run this in vLLM's environment (it has transformers)",
              file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"sparkcache: cannot write {args.dir}: {exc}", file=sys.stderr)
        return 1
    print(f"sparkcache: a random Llama ({CONFIG['num_hidden_layers']} layers, no tokenizer) "
          f"in {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
