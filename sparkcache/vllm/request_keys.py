"""Page keys of vLLM requests, on the scheduler side, from the config and the ``Request``.

- ``vllm_namespace``: the SparkCache ``Namespace`` of an engine, from its ``VllmConfig``
  alone (no tensors), so the scheduler process can key pages.
- ``RequestKeys``: the page keys of one request, updated as it grows; each ``update``
  keys only the pages completed since the last one: derived from vLLM's own block
  hashes where those are SHA-256 (``block_hash_keys``), else hashed from the tokens.
- ``KeyMemo``: a process-wide, bounded memory of the keys of requests seen, indexed by
  vLLM's own block hashes, so that the next turn of a conversation (a new request that
  re-sends the whole prefix) takes the keys of the prefix instead of re-hashing it.

What a key covers is exactly what vLLM's prefix-cache block hash covers
(``vllm.v1.core.kv_cache_utils``: ``hash_block_tokens`` over the block's tokens and
``generate_block_hash_extra_keys``), no less and no more:

- the tokens of the page and, chained, of every page before it;
- the LoRA adapter (vLLM: ``("lora", name, path)`` in every block) and the cache salt
  (vLLM: in the first block, then chained): request-wide ``KeyExtras`` (adapter = the
  JSON of ``[name, path]``; an empty salt is no salt, as in vLLM), which change every page
  exactly as vLLM's do;
- every other extra key vLLM gives the block (the identifier and start offset of each
  multimodal input overlapping it, the digest of its prompt embeddings): per-page
  extras, so a prefix before an image is shared exactly as far as vLLM shares it. They
  come from vLLM's own ``generate_block_hash_extra_keys`` (asked only for requests with
  multimodal inputs or prompt embeddings: vLLM 0.33 gives other requests no keys but
  LoRA and salt), each key as one canonical JSON string (bytes as hex, tuples and lists
  told apart), so a kind a later vLLM adds for such requests is covered too.

The namespace adds the model, KV dtype and layout, TP size and page size, which vLLM's
hash leaves to the engine it lives in. Keys derived from vLLM's hashes cover the same by
construction: vLLM's hash covers the tokens and extra keys, the seed the namespace and
the request-wide extras.

Not thread-safe: one scheduler thread calls it, as vLLM's scheduler is single-threaded.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Any

import numpy as np

from sparkcache.identity import KeyChain, KeyExtras, Namespace, chain_seed, keys_bytes
from sparkcache.vllm.block_hash_keys import CRYPTOGRAPHIC, DerivedChain, PageKeys

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# Extra-key kinds that RequestKeys folds in request-wide (see the module doc).
_REQUEST_WIDE = frozenset({"lora", "cache_salt"})
_UNQUANTIZED = frozenset({"float32", "float", "half", "float16", "bfloat16"})

# Sized for a few dozen 300k-token conversations at 16 tokens a page (see KeyMemo).
DEFAULT_MAX_PAGES = 32 * 300_000 // 16
DEFAULT_GRID = 32


# ---------------------------------------------------------------- namespace


def _kv_dtype(vllm_config: VllmConfig) -> str:
    """The KV cache dtype actually used: ``cache_dtype`` with "auto" resolved as vLLM
    resolves it (a checkpoint's KV quantization scheme, else the model dtype). Quantized
    formats keep their name: every fp8 / fp4 format is stored as uint8, so the storage
    dtype alone would let fp8_e4m3 and fp8_e5m2 pages meet. Layers left unquantized
    (``kv_cache_dtype_skip_layers``) are named too."""
    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    name = str(cache_config.cache_dtype)
    if name == "auto":
        try:
            from vllm.utils.torch_utils import resolve_kv_cache_dtype_string
        except ImportError:  # older vLLM: no checkpoint-declared KV scheme
            resolve_kv_cache_dtype_string = None
        if resolve_kv_cache_dtype_string is not None:
            name = resolve_kv_cache_dtype_string(name, model_config)
    if name == "auto":
        name = str(model_config.dtype).removeprefix("torch.")
    elif name in _UNQUANTIZED:
        from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

        name = str(STR_DTYPE_TO_TORCH_DTYPE[name]).removeprefix("torch.")
    skip = list(getattr(cache_config, "kv_cache_dtype_skip_layers", None) or ())
    if skip:
        name += "+unquantized:" + ",".join(str(s) for s in skip)
    return name


def kv_format(vllm_config: VllmConfig) -> str | None:
    """The KV cache format for the namespace where the tensors' storage dtype does not say
    it (None where it does: an unquantized cache, which keeps the namespace pages were
    stored under before). fp8 and fp4 formats are all uint8 tensors."""
    name = _kv_dtype(vllm_config)
    return None if name in _UNQUANTIZED else name


def model_variant(model_config: Any) -> dict[str, Any]:
    """What of the model's settings changes the KV of the same checkpoint and tokens: weight
    quantization, ``hf_overrides`` (where RoPE scaling and theta are set) and any RoPE
    settings of the config; empty where none is set, so a plain model's namespace stays
    what it was."""
    out: dict[str, Any] = {}
    quantization = getattr(model_config, "quantization", None)
    if quantization:
        out["quantization"] = str(quantization)
    overrides = getattr(model_config, "hf_overrides", None)
    if overrides:
        # A function rewriting the config cannot be named: its name is what there is.
        out["hf_overrides"] = (getattr(overrides, "__qualname__", repr(overrides))
                               if callable(overrides) else overrides)
    for name in ("rope_scaling", "rope_theta", "rope_parameters"):
        value = getattr(model_config, name, None)
        if value:
            out[name] = value
    return out


def model_identity(name: str, model_config: Any) -> str:
    """``name`` (the checkpoint, or the operator's ``model_id``), with ``model_variant``
    as JSON where the model has one."""
    variant = model_variant(model_config)
    if not variant:
        return name
    return json.dumps([name, variant], sort_keys=True, separators=(",", ":"), default=str)


def vllm_namespace(
    vllm_config: VllmConfig, memory_order: str, tp_size: int | None = None, *, rank: int = 0,
) -> Namespace:
    """The SparkCache namespace of the engine ``vllm_config`` describes, without tensors.

    - model: ``kv_connector_extra_config["model_id"]`` if given, else the JSON of
      ``[model_config.model, model_config.revision]`` (the name alone if no revision);
    - dtype: the KV cache dtype actually used (``_kv_dtype``);
    - layout: the per-rank geometry of a page: layers (``get_num_layers``: of this
      pipeline stage), KV heads per rank (``get_num_kv_heads``; 1 for MLA), head size,
      block size, MLA or not, and ``memory_order``, the connector's tag for how a page's
      bytes are ordered (e.g. "LBHNC", "LBNHC", "KBNHC");
    - ``tp_size``: the config's tensor-parallel size (given, it must agree);
    - page tokens: the KV block size.

    The rank is not part of the keys (``identity`` module doc); ``rank`` only fills the
    field.
    """
    if not isinstance(memory_order, str) or not memory_order or ":" in memory_order:
        raise ValueError(f"memory_order {memory_order!r}: a non-empty tag without ':'")
    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    config_tp = parallel_config.tensor_parallel_size
    if tp_size is None:
        tp_size = config_tp
    elif tp_size != config_tp:
        raise ValueError(
            f"tp_size {tp_size} != the config's tensor_parallel_size {config_tp}: the heads "
            f"per rank come from the config"
        )
    extra: dict[str, Any] = {}
    if vllm_config.kv_transfer_config is not None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    model_id = extra.get("model_id")
    if model_id is None:
        revision = model_config.revision
        model_id = (model_config.model if revision is None
                    else json.dumps([model_config.model, revision]))
    block_size = vllm_config.cache_config.block_size
    layout = ":".join([
        "vllm/v1",
        f"L{model_config.get_num_layers(parallel_config)}",
        f"H{model_config.get_num_kv_heads(parallel_config)}",
        f"D{model_config.get_head_size()}",
        f"B{block_size}",
        "mla" if model_config.use_mla else "mha",
        memory_order,
    ])
    return Namespace(model_identity(str(model_id), model_config), _kv_dtype(vllm_config),
                     layout, tp_size, rank, block_size)


# ---------------------------------------------------------------- extras


def _canon(value: object) -> object:
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value if type(value) is int else _refuse(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, tuple):
        return [_canon(v) for v in value]
    if isinstance(value, list):
        return {"list": [_canon(v) for v in value]}
    return _refuse(value)


def _refuse(value: object) -> object:
    raise TypeError(
        f"vLLM block extra key part {value!r} ({type(value).__name__}) has no canonical "
        f"text: this request cannot be keyed"
    )


def extra_key_text(key: object) -> str:
    """One vLLM extra key (e.g. ``("mm", identifier, offset)``) as canonical text: equal
    texts exactly for equal keys of the kinds vLLM uses (None, bool, int, str, bytes,
    tuples and lists of them). Anything else is a TypeError, never a guess."""
    return json.dumps(_canon(key), separators=(",", ":"), ensure_ascii=True)


def request_extras(request: Request) -> KeyExtras:
    """The request-wide extras of ``request``, read as vLLM's hasher reads them."""
    lora = request.lora_request
    salt = request.cache_salt or None  # vLLM: `if request.cache_salt`
    if not lora and salt is None:
        return _NO_EXTRAS  # most requests: no new (frozen, so slow to build) object each
    adapter = json.dumps([lora.lora_name, lora.lora_path]) if lora else None
    return KeyExtras(adapter=adapter, cache_salt=salt)


_NO_EXTRAS = KeyExtras()


def _has_block_extras(request: Request) -> bool:
    return bool(request.mm_features) or getattr(request, "prompt_embeds", None) is not None


def page_extras(request: Request, first: int, stop: int,
                page_tokens: int) -> dict[int, tuple[str, ...]]:
    """Per-page extras of pages ``first..stop-1``: vLLM's extra keys of each page's token
    range but the request-wide kinds (``generate_block_hash_extra_keys``)."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    out: dict[int, tuple[str, ...]] = {}
    if getattr(request, "prompt_embeds", None) is None:
        if not request.mm_features:
            return out
        last = request.mm_features[-1].mm_position  # vLLM: sorted by offset
        stop = min(stop, -(-(last.offset + last.length) // page_tokens))
    # vLLM's walk over the inputs, from the first: it skips those that end before a page.
    mm_idx = 0
    for page in range(first, stop):
        start = page * page_tokens
        keys, mm_idx = generate_block_hash_extra_keys(
            request, start, start + page_tokens, mm_idx
        )
        if keys:
            texts = tuple(extra_key_text(k) for k in keys
                          if not (isinstance(k, tuple) and k and k[0] in _REQUEST_WIDE))
            if texts:
                out[page] = texts
    return out


# ---------------------------------------------------------------- memo


# How many of a conversation's latest saves a request remembers (``_Entry.saved``).
SAVES_KEPT = 4


class _Entry:
    """The keys of one remembered request: its live key list (only ever appended to)."""

    __slots__ = ("anchors", "in_lru", "keys", "last", "live", "pages", "saved", "seed")

    def __init__(self, seed: bytes, keys: list[str]) -> None:
        self.seed = seed
        self.keys = keys
        # Pages saved by the requests of this conversation up to this one, oldest first
        # (``RequestKeys.note_saved``): where a prefix stored for it can end.
        self.saved: tuple[int, ...] = ()
        self.anchors: list[bytes] = []  # vLLM hashes anchored here for good
        self.last: bytes | None = None  # the moving anchor at the last page
        self.live = 0  # anchors that still point here
        self.pages = 0  # pages accounted while in the LRU
        self.in_lru = False


class KeyMemo:
    """Process-wide memory of page keys, indexed by vLLM block hashes; bounded.

    **Why a vLLM hash may stand for a SparkCache key.** vLLM's hash of block ``i`` of a
    request is ``H(hash of block i-1, tokens of block i, extra keys of block i)`` from
    ``NONE_HASH``: equal hashes (SHA-256 by default; a collision is not a concern) mean
    equal tokens and equal extra keys in every block ``0..i``, and so the same
    ``block_hashes[i]`` length. A SparkCache page key is a function of exactly those (plus
    the namespace): the tokens of pages ``0..p`` and the extras derived from vLLM's extra
    keys of the same ranges (module doc). So if two requests in the same namespace have
    the same vLLM hash at the block that ends page ``p``, their keys of pages ``0..p`` are
    equal, and one's can be taken for the other's. Checked on each hit as well: the
    remembered request's chain seed (namespace and request-wide extras) and page index.
    It holds only where ``block_hashes`` are vLLM's own, at the ``hash_block_size`` the
    caller gives (which must divide the page size; the block ending page ``p`` is then
    ``(p + 1) * page_tokens / hash_block_size - 1``), in this process (vLLM's hashes and
    ``NONE_HASH`` are per process), and only with a cryptographic hash: with xxhash a
    collision, which can be made, would have one request take another's keys, and its KV
    be saved under them in a durable store (``block_hash_keys.key_source`` turns the memo
    off there).

    **What is kept.** Per remembered request, its key list once (the live list of its
    ``RequestKeys``; pages are only ever appended, so an index into it stays valid), and
    anchors: vLLM block hash -> (request, page) for its last page and every ``grid``-th
    page. A new request looks its block hashes up from its end, one dict lookup a page
    (about 1/25 of hashing the page), and takes the first prefix found: the whole
    previous turn of a conversation (its last page), or after a branch the prefix to
    within ``grid`` pages. A request that takes a prefix takes over the anchors of its
    source on that prefix, so a conversation's previous turn, whose anchors all lie in
    the prefix, is dropped: the memo holds one key list per conversation, and the end
    of each earlier turn stays anchored.

    **Bound.** ``max_pages`` pages over the key lists remembered, least recently used
    first out (a list shared by prefix is counted by each holder: the bound is
    conservative). Measured (scripts/bench_keys.py, ``memo_bytes_per_page``): 22 bytes
    per page with keys derived from vLLM's hashes (16 raw bytes, an anchor every 32
    pages with the vLLM hash it keeps alive), 95 with keys hashed from the tokens (a
    32-character key string 81 B, its list slot 8 B); the default, 600k pages (32
    conversations of 300k tokens at 16 tokens a page), is about 13 MB or 57 MB.
    """

    def __init__(self, max_pages: int = DEFAULT_MAX_PAGES, grid: int = DEFAULT_GRID) -> None:
        if max_pages < 0 or grid < 1:
            raise ValueError(f"max_pages {max_pages} must be >= 0 and grid {grid} >= 1")
        self.max_pages = max_pages
        self.grid = grid
        self.pages = 0
        self.hits = 0
        self.misses = 0
        self.evicted = 0
        self._anchors: dict[bytes, tuple[_Entry, int]] = {}
        self._lru: OrderedDict[_Entry, None] = OrderedDict()

    def __len__(self) -> int:
        """Anchors held."""
        return len(self._anchors)

    @property
    def entries(self) -> int:
        """Key lists held."""
        return len(self._lru)

    def clear(self) -> None:
        for entry in self._lru:
            entry.in_lru, entry.live = False, 0
        self._anchors.clear()
        self._lru.clear()
        self.pages = 0

    def find(self, seed: bytes, block_hashes: list, blocks_per_page: int, lo: int,
             hi: int) -> tuple[_Entry, int] | None:
        """The longest remembered prefix ending at a page in ``lo..hi-1``: (remembered
        request, page; its ``keys[:page + 1]`` are the prefix's), or None.
        ``block_hashes`` must hold the hash of page ``hi-1``'s last block."""
        if hi <= lo or not self._anchors:
            return None
        get, k, grid = self._anchors.get, blocks_per_page, self.grid
        # A remembered prefix has its grid pages anchored and ends within a grid of the
        # last of them: look up the grid pages from the end, then the pages after the
        # one found, one by one, iterated in C (map, filter). Looking up every page of a
        # new 300k-token prompt, all misses, took 8.5 ms in a Python loop on a loaded
        # host (1.6 in C); the grid pages are 1/32 of them. A prefix whose grid anchors
        # went with an evicted list is found shorter, or not: its keys are derived or
        # hashed again, never wrong.
        top = hi // grid * grid - 1  # the last grid page below hi
        below = lo // grid * grid - 1  # the last grid page below lo
        grid_hashes = block_hashes[(top + 1) * k - 1 : (below + 1) * k - 1 if below >= 0
                                   else None : -grid * k] if top >= lo else []
        base = next((found for found in filter(None, map(get, grid_hashes))
                     if self._holds(found, seed, block_hashes, k, lo, hi)), None)
        first = base[1] + 1 if base is not None else lo
        stop = min(hi, first + grid)
        tail = block_hashes[stop * k - 1 : first * k - 1 if first else None : -k]
        found = next((found for found in filter(None, map(get, tail))
                      if self._holds(found, seed, block_hashes, k, lo, hi)), base)
        if found is not None:
            self.hits += 1
            self._lru_touch(found[0])
            return found
        self.misses += 1
        return None

    def _holds(self, found: tuple[_Entry, int], seed: bytes, block_hashes: list, k: int,
               lo: int, hi: int) -> bool:
        """Whether an anchor found among ``block_hashes`` stands for this request's page:
        the same seed, and the hash at that page's last block its key (one tuple a key)."""
        entry, page = found
        return (lo <= page < hi and entry.seed == seed
                and found is self._anchors.get(block_hashes[(page + 1) * k - 1]))

    def remember(self, entry: _Entry, block_hashes: list, blocks_per_page: int, lo: int,
                 hi: int, source: _Entry | None = None, upto: int = -1) -> None:
        """Anchor ``entry``'s pages ``lo..hi-1`` (their hashes in ``block_hashes``): every
        grid page, and ``hi-1`` as its moving last anchor; with ``source``, the request
        whose pages ``0..upto`` it took, take over the anchors of ``source`` on those
        pages instead (so that a previous turn is dropped). Then account and bound. An
        entry longer than the bound is not remembered."""
        if len(entry.keys) > self.max_pages:
            if entry.in_lru:
                self._evict(entry)
            return
        anchors, k, grid = self._anchors, blocks_per_page, self.grid
        if source is not None and source is not entry:
            self._take_over(entry, source, upto)
            lo = max(lo, upto + 1)  # the grid pages up to ``upto`` came with them
        first_grid = -(-(lo + 1) // grid) * grid - 1
        grid_hashes = block_hashes[(first_grid + 1) * k - 1 : hi * k : grid * k]
        if any(map(anchors.__contains__, grid_hashes)):
            for page in range(first_grid, hi, grid):
                self._anchor(block_hashes[(page + 1) * k - 1], entry, page)
        elif grid_hashes:  # none anchored yet (a new prompt): all at once, in C
            pages = zip(repeat(entry), range(first_grid, hi, grid), strict=False)
            anchors.update(zip(grid_hashes, pages, strict=True))
            entry.anchors.extend(grid_hashes)
            entry.live += len(grid_hashes)
        last = block_hashes[hi * k - 1] if hi > 0 and hi % grid else None
        if entry.last is not None and entry.last != last:
            old = anchors.get(entry.last)
            if old is not None and old[0] is entry:
                del anchors[entry.last]
                entry.live -= 1
            entry.last = None
        if last is not None and entry.last is None:
            old = anchors.get(last)
            if old is None or old[0] is not entry:  # else: a fixed anchor already
                anchors[last] = (entry, hi - 1)
                entry.live += 1
                entry.last = last
                if old is not None:
                    self._release(old[0], last)
        if entry.live > 0:
            self._account(entry)

    def _take_over(self, entry: _Entry, source: _Entry, upto: int) -> None:
        """Point ``source``'s anchors on pages ``0..upto`` at ``entry`` (whose keys of
        those pages are ``source``'s); drop ``source`` if none is left."""
        anchors, moved = self._anchors, []
        for vh in (*source.anchors, source.last):
            found = anchors.get(vh) if vh is not None else None
            if found is not None and found[0] is source and found[1] <= upto:
                anchors[vh] = (entry, found[1])
                moved.append(vh)
        if not moved:
            return
        entry.anchors.extend(moved)
        entry.live += len(moved)
        source.live -= len(moved)
        if source.last is not None and anchors.get(source.last, (None,))[0] is not source:
            source.last = None
        if source.live <= 0:
            source.anchors = []
            if source.in_lru:
                self._drop(source)

    def _anchor(self, vh: bytes, entry: _Entry, page: int) -> None:
        old = self._anchors.get(vh)
        if old is not None and old[0] is entry:
            return
        self._anchors[vh] = (entry, page)
        entry.live += 1
        entry.anchors.append(vh)
        if old is not None:
            self._release(old[0], vh)

    def _release(self, entry: _Entry, vh: bytes) -> None:
        """``vh`` no longer points at ``entry``."""
        entry.live -= 1
        if entry.last == vh:
            entry.last = None
        if entry.live <= 0 and entry.in_lru:
            self._drop(entry)

    def _drop(self, entry: _Entry) -> None:
        del self._lru[entry]
        entry.in_lru = False
        self.pages -= entry.pages
        entry.pages = 0

    def _lru_touch(self, entry: _Entry) -> None:
        if entry.in_lru:
            self._lru.move_to_end(entry)

    def _account(self, entry: _Entry) -> None:
        size = len(entry.keys)
        if entry.in_lru:
            self.pages += size - entry.pages
            self._lru.move_to_end(entry)
        else:
            self._lru[entry] = None
            entry.in_lru = True
            self.pages += size
        entry.pages = size
        while self.pages > self.max_pages and self._lru:
            self._evict(next(iter(self._lru)))

    def _evict(self, entry: _Entry) -> None:
        self._drop(entry)
        self.evicted += 1
        anchors = self._anchors
        for vh in (*entry.anchors, entry.last):
            found = anchors.get(vh) if vh is not None else None
            if found is not None and found[0] is entry:
                del anchors[vh]
        entry.anchors = []
        entry.last = None
        entry.live = 0


_DEFAULT_MEMO: KeyMemo | None = None


def default_memo() -> KeyMemo:
    """The process-wide memo (made on first use, with the default bound)."""
    global _DEFAULT_MEMO
    if _DEFAULT_MEMO is None:
        _DEFAULT_MEMO = KeyMemo()
    return _DEFAULT_MEMO


_DEFAULT: Any = object()


# ---------------------------------------------------------------- per request


class RequestKeys:
    """The page keys of one vLLM request so far, updated as it grows.

    ``update(request)`` reads ``request.num_tokens`` / ``all_token_ids``, ``mm_features``,
    ``prompt_embeds``, ``lora_request`` and ``cache_salt`` as vLLM's block hasher does and
    hashes only the pages completed since the last call, unless a remembered request
    (``KeyMemo``) already has their keys. ``keys`` is the live list of hex keys, one per
    full page (do not modify it); partial pages have no key here.

    The memo is used when ``hash_block_size`` (vLLM's ``kv_cache_config.hash_block_size``,
    the granularity of ``request.block_hashes``) is given and divides the page size, and
    ``request.block_hashes`` has the length vLLM's hasher gives it (``(num_tokens -
    lookahead_tokens) // hash_block_size``; ``lookahead_tokens`` is
    ``vllm_config.num_hash_lookahead_tokens``): otherwise pages are hashed, which is
    always right. ``memo=None`` turns it off; it must be off unless vLLM's hash is
    cryptographic (``block_hash_keys.key_source``).

    With ``block_hash_algo`` (vLLM's prefix-caching hash, one of
    ``block_hash_keys.CRYPTOGRAPHIC``, as ``key_source`` chose it) keys are derived from
    the vLLM block hashes instead of hashed from the tokens (``block_hash_keys``), as
    raw bytes (``PageKeys``); only pages with a vLLM hash then have a key. That needs
    ``hash_block_size`` dividing the page and no lookahead.

    If the tokens change under it rather than grow (vLLM's streaming sessions drop the last
    sampled token before appending), the chain starts again: noticed by the last page's
    tokens and, where known, vLLM's hash of it.
    """

    __slots__ = ("_algo", "_anchored", "_chain", "_entry", "_k", "_last_tokens", "_last_vh",
                 "_lookahead", "_memo", "_seed", "hashed_pages", "memo_conflicts",
                 "memo_pages", "namespace", "page_tokens", "restarts")

    def __init__(self, namespace: Namespace, request: Request | None = None, *,
                 hash_block_size: int | None = None, lookahead_tokens: int = 0,
                 memo: KeyMemo | None = _DEFAULT, block_hash_algo: str | None = None) -> None:
        self.namespace = namespace
        self.page_tokens = namespace.page_tokens
        self._memo = default_memo() if memo is _DEFAULT else memo
        self._k = 0  # vLLM blocks per page; 0: the memo is not used
        if (hash_block_size is not None and hash_block_size > 0
                and self.page_tokens % hash_block_size == 0):
            self._k = self.page_tokens // hash_block_size
        self._lookahead = lookahead_tokens
        if block_hash_algo is not None and (
                block_hash_algo not in CRYPTOGRAPHIC or not self._k or lookahead_tokens):
            raise ValueError(
                f"keys from vLLM's block hashes need a hash of {CRYPTOGRAPHIC} (got "
                f"{block_hash_algo!r}), blocks dividing the page ({hash_block_size} tokens "
                f"for {self.page_tokens}) and no lookahead ({lookahead_tokens})")
        self._algo = block_hash_algo
        self._chain: KeyChain | DerivedChain | None = None
        self.hashed_pages = 0  # pages hashed here, over this object's life
        self.memo_pages = 0  # pages taken from the memo
        self.restarts = 0
        self.memo_conflicts = 0
        if request is not None:
            self.update(request)

    @property
    def keys(self) -> Sequence[str]:
        """Full-page keys so far, as the live sequence (do not modify): a list of hex
        strings, or ``PageKeys`` for keys derived from vLLM's hashes."""
        return self._chain.keys if self._chain is not None else []

    def key_bytes(self, start: int, stop: int) -> bytes:
        """The raw keys of pages ``start..stop-1`` (``identity.keys_bytes``), as the
        workers take them."""
        keys = self.keys
        if isinstance(keys, PageKeys):
            return keys.raw(start, stop)
        return keys_bytes(keys[start:stop])

    def note_saved(self, pages: int) -> None:
        """This request's first ``pages`` pages were handed to the store: a later turn of
        the conversation, which takes its keys from this one, may find a prefix stored
        to there (``expected_ends``)."""
        if self._chain is not None and pages > 0:
            self._entry.saved = (*self._entry.saved, pages)[-SAVES_KEPT:]

    def expected_ends(self) -> tuple[int, ...]:
        """Where the stored prefix of this request is likeliest to end, likeliest first:
        the pages its conversation's previous turn had (taken from the memo), then the
        ends of the conversation's latest saves, newest first. A turn sent the moment the
        one before finished finds that one's pages not yet committed, and the prefix the
        turn before it saved stored."""
        ends = [self.memo_pages] if self.memo_pages else []
        if self._chain is not None:
            ends += [n for n in reversed(self._entry.saved) if n not in ends]
        return tuple(ends)

    def __len__(self) -> int:
        return len(self._chain) if self._chain is not None else 0

    def _start(self, request: Request) -> KeyChain | DerivedChain:
        extra = request_extras(request)
        chain: KeyChain | DerivedChain
        if self._algo is None:
            chain = KeyChain(self.namespace, extra)
            self._seed = chain_seed(self.namespace, extra)
        else:
            chain = DerivedChain(chain_seed(self.namespace, extra), self._algo)
            self._seed = chain.seed  # never a token chain's: the memo keeps them apart
        self._chain = chain
        self._entry = _Entry(self._seed, chain.keys)
        self._anchored = 0  # pages 0.._anchored-1 have had their grid anchors set
        self._last_tokens: list[int] | None = None
        self._last_vh: bytes | None = None
        return chain

    def _same(self, request: Request, tokens: Any, have: int) -> bool:
        """Whether pages ``0..have-1`` still hold what they were hashed from."""
        end = have * self.page_tokens
        if request.num_tokens < end or tokens[end - self.page_tokens : end] != self._last_tokens:
            return False
        if self._last_vh is not None:
            hashes = request.block_hashes
            at = have * self._k - 1
            if at < len(hashes) and hashes[at] != self._last_vh:
                return False
        return True

    def update(self, request: Request) -> Sequence[str]:
        """Bring the keys up to ``request``'s full pages; returns ``keys``."""
        chain = self._chain or self._start(request)
        tokens = request.all_token_ids
        have = len(chain)
        if have and not self._same(request, tokens, have):
            self.restarts += 1
            chain, have = self._start(request), 0
        num_tokens = request.num_tokens
        step = self.page_tokens
        pages = num_tokens // step
        if pages <= have:
            return chain.keys

        hashes, hashed, k, memo = None, 0, self._k, self._memo
        if k and (memo is not None or self._algo is not None):
            hashes = request.block_hashes
            if len(hashes) == max(0, num_tokens - self._lookahead) // (step // k):
                hashed = min(pages, len(hashes) // k)  # pages with vLLM's hash
        if self._algo is not None:
            pages = hashed  # a page without vLLM's hash has no key
            if pages <= have:
                return chain.keys
        avail = hashed if memo is not None else 0
        source, upto = None, -1
        if avail > have:
            found = memo.find(self._seed, hashes, k, have, avail)
            if found is not None:
                entry, page = found
                try:
                    chain.adopt(entry.keys, page + 1)
                except ValueError:  # cannot happen if KeyMemo's argument holds
                    self.memo_conflicts += 1
                    log.warning("memo prefix disagrees with the keys hashed so far: ignored",
                                exc_info=True)
                else:
                    source, upto = entry, page
                    self.memo_pages += page + 1 - have
                    have = page + 1
                    self._entry.saved = tuple(n for n in entry.saved if n <= have)
        if pages > have:
            if isinstance(chain, DerivedChain):
                chain.extend(hashes, k, pages)
            else:
                extras = (page_extras(request, have, pages, step)
                          if _has_block_extras(request) else None)
                data = np.asarray(tokens[have * step : pages * step], dtype=np.int64)
                chain.extend(data, page_extras=extras)
            self.hashed_pages += pages - have
        self._last_tokens = tokens[(pages - 1) * step : pages * step]
        self._last_vh = None
        if avail:
            memo.remember(self._entry, hashes, k, self._anchored, avail, source, upto)
            self._anchored = avail
        if hashed == pages:
            self._last_vh = hashes[pages * k - 1]
        return chain.keys
