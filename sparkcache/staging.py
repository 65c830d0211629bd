"""``StagingPool``: shared-memory pages standing in for an engine's private KV blocks.

vLLM's CPU backend keeps its KV cache in ordinary process memory that no other process
can open. SparkCache's workers read and write KV only through memory they can open, so
such an engine makes the one unavoidable copy per page itself: into a staging page when
it saves (capture then reads the staging page), and out of one when it loads (restore
wrote it). The pool's tensors have the engine's per-page shape and dtype with their own
block count, so a staging page's bytes are exactly the engine page's bytes
(``kvmem.BlockViews`` reads both in logical order) and the keys do not change.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparkcache import kvmem


class StagingPool:
    """``blocks`` staging pages in one shared-memory segment of this process (0600,
    unlinked by ``close``), and which of them are free."""

    def __init__(self, instance: str, rank: int, engine: Sequence[torch.Tensor],
                 block_dim: int, blocks: int) -> None:
        dtypes = {t.dtype for t in engine}
        if len(dtypes) != 1:
            raise ValueError(f"KV tensors of several dtypes {sorted(map(str, dtypes))}: "
                             f"one staging pool needs one")
        if blocks < 1:
            raise ValueError(f"a staging pool of {blocks} pages: at least 1 is needed")
        self.engine = list(engine)
        self.block_dim = block_dim
        shapes = [(blocks, *[n for i, n in enumerate(t.shape) if i != block_dim])
                  for t in self.engine]
        self.shared = kvmem.SharedKVCaches.create(instance, rank, shapes, dtypes.pop())
        self.tensors = self.shared.tensors
        self.blocks = blocks
        self._free = list(range(blocks - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int] | None:
        """``n`` free staging pages, or None if fewer are free (nothing taken)."""
        if n > len(self._free):
            return None
        taken = self._free[-n:] if n else []
        del self._free[len(self._free) - n:]
        return taken

    def give_back(self, pages: Sequence[int]) -> None:
        self._free.extend(pages)

    def copy_in(self, engine_blocks: Sequence[int], pages: Sequence[int]) -> None:
        """Engine blocks -> staging pages, one gather per layer."""
        src = torch.tensor(list(engine_blocks), dtype=torch.long)
        dst = torch.tensor(list(pages), dtype=torch.long)
        for t, s in zip(self.engine, self.tensors, strict=True):
            s.index_copy_(0, dst, t.index_select(self.block_dim, src).movedim(self.block_dim, 0))

    def copy_out(self, pages: Sequence[int], engine_blocks: Sequence[int]) -> None:
        """Staging pages -> engine blocks, one scatter per layer."""
        src = torch.tensor(list(pages), dtype=torch.long)
        dst = torch.tensor(list(engine_blocks), dtype=torch.long)
        for t, s in zip(self.engine, self.tensors, strict=True):
            t.index_copy_(self.block_dim, dst, s.index_select(0, src).movedim(0, self.block_dim))

    def close(self) -> None:
        self.tensors = []
        self.engine = []
        self.shared.close()
