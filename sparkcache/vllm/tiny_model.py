"""A small Llama with random weights, made offline, to try SparkCache beside vLLM where
no model can be downloaded (docs/vllm.md, "Walkthrough on a CPU host"):

    python -m sparkcache.vllm.tiny_model /tmp/tiny-llama

Four layers of 512, eight KV heads of 64, float32: 16 KiB of KV a token, 512 KiB a page
of 32 tokens; large enough that vLLM's CPU engine takes seconds to recompute a prefix of
a few thousand tokens, so a restore shows. It has no tokenizer: give vLLM
``--skip-tokenizer-init`` and prompts as token ids (``sparkcache.vllm.two_turns`` does).
Its replies are noise, but the same noise for the same KV: a restore that serves wrong
KV changes them. Needs ``transformers`` (vLLM installs it).

``--hybrid``: a Gemma 3 instead, six layers of 256, four of them with sliding-window
attention (``--window`` tokens, 128 by default) and two with full attention, two KV
heads of 64: a model vLLM's hybrid KV cache manager serves with a KV cache group per
kind (docs/vllm.md, "Hybrid models")."""

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
HYBRID_LAYERS = ["sliding_attention", "sliding_attention", "full_attention"] * 2
HYBRID_CONFIG = {
    "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": len(HYBRID_LAYERS),
    "layer_types": HYBRID_LAYERS, "vocab_size": 1024, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    # Gemma 3 normalises q and k per head, so the weights' range alone leaves attention
    # flat: an attention scale of 1 (not 1/8) makes it depend on the KV. Tied
    # embeddings make a random Gemma 3 repeat its input token whatever the KV.
    "query_pre_attn_scalar": 1, "tie_word_embeddings": False,
    "torch_dtype": "float32", "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
}


def write(path: Path, seed: int = 0, window: int | None = None) -> Path:
    """Write the model's config and weights (safetensors) into ``path``; with a
    ``window`` (tokens), the hybrid Gemma 3."""
    import torch

    torch.manual_seed(seed)
    if window is None:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**CONFIG, initializer_range=INITIALIZER_RANGE))
    else:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        model = Gemma3ForCausalLM(Gemma3TextConfig(
            **HYBRID_CONFIG, sliding_window=window, initializer_range=INITIALIZER_RANGE))
    model.save_pretrained(path, safe_serialization=True)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sparkcache.vllm.tiny_model",
        description="Write a small random Llama for trying SparkCache beside vLLM offline.")
    parser.add_argument("dir", type=Path, help="where to write it (created)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hybrid", action="store_true",
                        help="a Gemma 3 with sliding-window and full-attention layers")
    parser.add_argument("--window", type=int, default=128,
                        help="its sliding window, in tokens (with --hybrid)")
    args = parser.parse_args(argv)
    if args.window < 2:
        parser.error(f"--window {args.window}: at least 2 tokens")
    try:
        write(args.dir, args.seed, args.window if args.hybrid else None)
    except ImportError as exc:
        print(f"sparkcache: {exc}: run this in vLLM's environment (it has transformers)",
              file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"sparkcache: cannot write {args.dir}: {exc}", file=sys.stderr)
        return 1
    what = (f"Gemma 3 ({len(HYBRID_LAYERS)} layers, window {args.window} tokens in 4)"
            if args.hybrid else f"Llama ({CONFIG['num_hidden_layers']} layers)")
    print(f"sparkcache: a random {what}, no tokenizer, in {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
