"""The engine's stand-in for a model forward: matrix work whose cost is what matters.

A decode step costs the same whatever the batch (on a GPU a small decode batch is bound
by reading the weights, not by the rows), so it is one fixed stack of matmuls sized to
take a few ms on one core. Prefill costs per token: the step's prefill tokens go through
the same stack in chunks, ``prefill_passes`` times, so a 2k-token tail costs several
decode steps, as it does on a GPU (a 75 ms decode step there is worth ~150 prompt tokens
of prefill; here ~130).

The weights (1 MiB of fp32) fit a core's own L2 cache: a GPU's step does not slow down
when another core fills the shared L3 or the memory bus, and a stack that streamed its
weights from L3 on every step would measure the guest's neighbours rather than the
store. torch releases the GIL inside each matmul, as a CUDA launch returns to Python:
threads of the same process (the inline lane) run between and beside them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    layers: int = 4
    hidden: int = 256  # [rows, hidden] @ [hidden, hidden] per layer
    decode_rows: int = 512
    prefill_chunk: int = 256  # prompt tokens per pass of the stack
    prefill_passes: int = 4
    max_batched_tokens: int = 2048  # prefill tokens one step may take (chunked prefill)


class ToyModel:
    def __init__(self, shape: ModelShape = ModelShape(), seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.shape = shape
        scale = shape.hidden ** -0.5
        self._w = [torch.randn(shape.hidden, shape.hidden, generator=gen) * scale
                   for _ in range(shape.layers)]
        self._x = torch.randn(shape.decode_rows, shape.hidden, generator=gen)
        self._xp = torch.randn(shape.prefill_chunk, shape.hidden, generator=gen)

    def _stack(self, x: torch.Tensor) -> None:
        for w in self._w:
            x = torch.tanh(x @ w)

    def forward(self, decode: int, prefill_tokens: int) -> None:
        """One engine step: the decode stack if any request decodes, and the prefill
        passes over ``prefill_tokens`` tokens in chunks."""
        if decode:
            self._stack(self._x)
        chunk = self.shape.prefill_chunk
        done = 0
        while done < prefill_tokens:
            n = min(chunk, prefill_tokens - done)
            for _ in range(self.shape.prefill_passes):
                self._stack(self._xp[:n])
            done += n
