"""The engine's stand-in for a model forward: matrix work whose cost is what matters.

A decode step costs the same whatever the batch (on a GPU a small decode batch is bound
by reading the weights, not by the rows), so it is one fixed stack of matmuls sized to
take a few ms on one core. Prefill costs per token: the step's prefill tokens go through
a smaller stack in chunks, so a 2k-token tail costs several decode steps, as it does on
a GPU. torch releases the GIL inside each matmul, like a CUDA launch returns to Python:
threads of the same process (the inline lane) can run between and beside them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    layers: int = 4
    hidden: int = 1024  # decode: [decode_rows, hidden] @ [hidden, hidden] per layer
    decode_rows: int = 32
    prefill_hidden: int = 512  # prefill: [chunk, prefill_hidden] @ [.., ..] per layer
    prefill_chunk: int = 256
    max_batched_tokens: int = 2048  # prefill tokens one step may take (chunked prefill)


class ToyModel:
    def __init__(self, shape: ModelShape = ModelShape(), seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.shape = shape
        scale_d = shape.hidden ** -0.5
        scale_p = shape.prefill_hidden ** -0.5
        self._w = [torch.randn(shape.hidden, shape.hidden, generator=gen) * scale_d
                   for _ in range(shape.layers)]
        self._wp = [torch.randn(shape.prefill_hidden, shape.prefill_hidden,
                                generator=gen) * scale_p for _ in range(shape.layers)]
        self._x = torch.randn(shape.decode_rows, shape.hidden, generator=gen)
        self._xp = torch.randn(shape.prefill_chunk, shape.prefill_hidden, generator=gen)

    def forward(self, decode: int, prefill_tokens: int) -> None:
        """One engine step: the decode stack if any request decodes, and the prefill stack
        over ``prefill_tokens`` tokens in chunks."""
        if decode:
            y = self._x
            for w in self._w:
                y = torch.tanh(y @ w)
        chunk = self.shape.prefill_chunk
        done = 0
        while done < prefill_tokens:
            n = min(chunk, prefill_tokens - done)
            y = self._xp[:n]
            for w in self._wp:
                y = torch.tanh(y @ w)
            done += n
