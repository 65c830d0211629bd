"""vLLM's KV cache groups, as SparkCache stores them: which are supported, and the page
keys and blocks of one stored prefix across all of them.

With the hybrid memory allocator (HMA) a model with full-attention and sliding-window
layers has a KV cache group per kind (vLLM splits the layers into groups of equal size);
each group has a block table of its own, drawn from one block pool, and the KV tensors
are shared: tensor ``i`` holds layer ``i`` of every group, and block ``b`` belongs to
whichever group allocated it. A page of block ``b`` is therefore block ``b`` of every
tensor, as without HMA; what differs is which blocks hold what:

* a **full-attention** group keeps every block of a request: its pages are stored for
  every position, as a model without HMA has them stored;
* a **sliding-window** group frees the blocks that fell out of the window (vLLM puts its
  null block in their place), and a later turn needs only the window before where it
  resumes: ``window_pages`` pages (vLLM's ``cdiv(sliding_window - 1, block_size)``).

One save of a prefix of ``P`` pages is one publication, one root: the *composite* of
``P`` pages of every full-attention group followed by the last ``window_pages`` pages
before ``P`` of every sliding-window group (``Composite``). The first full-attention
group (the anchor) keeps the request's own page keys, so everything keyed by them (the
key memo, the saves a turn waits for, KV events) is unchanged; every other group's keys
are derived from the anchor's (``group_key``): they name the same tokens, and pages of
different groups never meet. A lookup finds the anchor's prefix, then checks that the
composite ending there is stored whole: the windows of one save are stored, leased and
evicted with its prefix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sparkcache.identity import KEY_BYTES

FULL = "full"
SLIDING_WINDOW = "sliding_window"
# vLLM's null block (the first of its pool): what a sliding-window group's table holds
# where a block fell out of the window.
NULL_BLOCK = 0
_PERSON = b"sparkcache-group"


@dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV cache groups: its index in vLLM's ``kv_cache_groups``, its kind
    and, for a sliding-window group, the pages a resumed request needs before it."""

    index: int
    kind: str
    layer_names: tuple[str, ...]
    sliding_window: int = 0  # tokens (sliding-window groups)
    window_pages: int = 0


@dataclass(frozen=True)
class KVGroups:
    """The groups of an engine, the anchor first, then the other full-attention groups,
    then the sliding-window groups: the order of a composite's parts."""

    groups: tuple[KVGroup, ...]
    block_size: int

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    def signature(self) -> str:
        """Part of the namespace: pages saved under one grouping are not another's."""
        parts = [f"{g.index}:{g.kind}:{g.sliding_window}:{','.join(g.layer_names)}"
                 for g in self.groups]
        return hashlib.blake2b(";".join(parts).encode(), digest_size=8).hexdigest()

    def composite(self, anchor: bytes, start: int, end: int,
                  tables: Sequence[Sequence[int]] | None = None) -> Composite:
        """The pages ``[start, end)`` of the composite ending at page ``end``, given the
        anchor's raw keys of pages ``[0, end)`` and each group's blocks (vLLM's block ids
        by group index; None: keys only)."""
        head = Composite(anchor[start * KEY_BYTES:end * KEY_BYTES],
                         list(tables[self.groups[0].index][start:end]) if tables is not None
                         else [])
        rest = self.derived(anchor, start, end, tables)
        return Composite(head.keys + rest.keys, head.blocks + rest.blocks)

    def derived(self, anchor: bytes, start: int, end: int,
                tables: Sequence[Sequence[int]] | None = None) -> Composite:
        """The composite's parts after the anchor's: the other groups' pages, with keys
        derived from the anchor's (what a lookup asks beyond the anchor's prefix)."""
        raw: list[bytes] = []
        blocks: list[int] = []
        for g in self.groups[1:]:
            first = start if g.kind == FULL else max(start, end - g.window_pages)
            raw += [group_key(anchor[i * KEY_BYTES:(i + 1) * KEY_BYTES], g.index)
                    for i in range(first, end)]
            if tables is not None:
                blocks += tables[g.index][first:end]
        return Composite(b"".join(raw), blocks)

    def windows_held(self, tables: Sequence[Sequence[int]], end: int,
                     computed: int | None = None) -> bool:
        """Whether every sliding-window group still holds the window before page ``end``:
        none of its blocks there is vLLM's null block and, for ``tables`` tracked from
        the scheduler's outputs (which never say that a block fell out of the window),
        none lies below what vLLM frees once ``computed`` tokens are computed (its
        ``get_num_skipped_tokens``): such an entry may name a block another request
        holds by now."""
        for g in self.groups:
            if g.kind != SLIDING_WINDOW:
                continue
            first = max(0, end - g.window_pages)
            window = tables[g.index][first:end]
            if len(window) < end - first or NULL_BLOCK in window:
                return False
            if computed is not None and \
                    first < max(0, computed - g.sliding_window + 1) // self.block_size:
                return False
        return True


@dataclass(frozen=True)
class Composite:
    """Raw page keys (``KEY_BYTES`` each) and, where asked for, their blocks."""

    keys: bytes
    blocks: list[int]

    def hex_keys(self) -> list[str]:
        k = self.keys
        return [k[i:i + KEY_BYTES].hex() for i in range(0, len(k), KEY_BYTES)]


def group_key(anchor_key: bytes, group_index: int) -> bytes:
    """Group ``group_index``'s key of the page whose anchor key is ``anchor_key``: a
    digest of it, so it names the same tokens (and the whole prefix before them, as the
    anchor's key does) and no other group's page."""
    return hashlib.blake2b(anchor_key + group_index.to_bytes(4, "little"),
                           digest_size=KEY_BYTES, person=_PERSON).digest()


class UnsupportedGroups(ValueError):
    """KV cache groups SparkCache cannot store; the message names them and the remedy."""


# Where vLLM's hybrid allocator off serves the model (it then keeps every attention
# layer's blocks, as full attention): local attention, and block sizes that differ.
_HMA_OFF = ("start vLLM with --disable-hybrid-kv-cache-manager to serve this model with "
            "SparkCache (every layer's blocks kept, as full attention)")
_WITHOUT = "not supported: serve this model without the SparkCache connector"


def from_kv_cache_config(kv_cache_config: Any, block_size: int) -> KVGroups | None:
    """The groups of vLLM's ``kv_cache_config``; None where it has none to tell (an
    older vLLM, a test without one). Raises ``UnsupportedGroups`` for a group SparkCache
    cannot store exactly: cross-attention (encoder-decoder), Mamba and other recurrent
    state, chunked-local attention, sliding windows in every layer (no full-attention
    prefix to find a window's end by), or groups of another block size than the pages'."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not isinstance(groups, list | tuple) or not groups:
        return None
    from vllm.v1 import kv_cache_interface as kvi

    full_types = tuple(getattr(kvi, n) for n in ("FullAttentionSpec", "MLAAttentionSpec")
                       if hasattr(kvi, n))
    # Subclasses of the full-attention spec that free or reuse blocks of their own.
    not_full = tuple(getattr(kvi, n) for n in ("RSWASpec", "SinkFullAttentionSpec",
                                               "HiddenStateCacheSpec") if hasattr(kvi, n))
    local = tuple(getattr(kvi, n) for n in ("ChunkedLocalAttentionSpec",) if hasattr(kvi, n))
    found: list[KVGroup] = []
    unsupported: list[str] = []
    hma_off_serves = True
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        inner = list(getattr(spec, "kv_cache_specs", {}).values())  # UniformTypeKVCacheSpecs
        if inner and all(type(s) is type(inner[0]) and s.block_size == inner[0].block_size
                         and getattr(s, "sliding_window", None)
                         == getattr(inner[0], "sliding_window", None) for s in inner):
            spec = inner[0]  # layers of one kind, only their shapes differ
        names = tuple(group.layer_names)
        spec_block = int(getattr(spec, "block_size", block_size))
        if spec_block != block_size:
            unsupported.append(f"group {index} ({type(spec).__name__}) has blocks of "
                               f"{spec_block} tokens, not {block_size}")
        elif isinstance(spec, kvi.SlidingWindowSpec):
            window = int(spec.sliding_window)
            found.append(KVGroup(index, SLIDING_WINDOW, names, window,
                                 -(-(window - 1) // block_size)))
        elif isinstance(spec, full_types) and not isinstance(spec, not_full):
            found.append(KVGroup(index, FULL, names))
        else:
            unsupported.append(f"group {index} is {type(spec).__name__}")
            hma_off_serves &= isinstance(spec, local)
    if unsupported:
        raise UnsupportedGroups("KV cache " + "; ".join(unsupported) + ": "
                                + (_HMA_OFF if hma_off_serves else _WITHOUT))
    full = [g for g in found if g.kind == FULL]
    if not full:
        raise UnsupportedGroups("every layer has sliding-window attention (no "
                                "full-attention layer to find a window's end by): "
                                + _WITHOUT)
    return KVGroups(tuple(full + [g for g in found if g.kind != FULL]), block_size)
