"""Page identity: a namespace seed and chained, domain-separated page keys.

A page key is ``h_i = H(h_{i-1}, tokens of page i[, extras of page i])`` where ``h_{-1}`` is
the request's chain seed: the namespace seed, with the request's ``KeyExtras`` folded in if
it has any. Because every key folds in its whole prefix and the namespace, two pages share
a key exactly when they hold the same tokens and the same extras after the same prefix,
for the same model, dtype, KV layout, tensor-parallel size, page size and format: keys
from another namespace never hit.

The namespace holds what determines a page's bytes and nothing else: in particular not
the number of KV blocks, which vLLM sizes by profiling free memory at every start, so a
restarted engine finds the pages it stored before, and not the rank. Each rank stores
its pages in its own directory (``rank-<r>/``), so the same key at two ranks never
meets; what differs between ranks' bytes, the heads each holds, is fixed by ``tp_size``
and ``kv_layout``. Leaving the rank out lets the scheduler compute one chain for all
TP ranks. ``Namespace.rank`` is kept for callers that record it, but is neither hashed
nor compared: two namespaces that differ only in rank are equal and give equal keys.

What a request adds beyond its tokens comes in two kinds, both covering exactly what
vLLM's prefix-cache block hash covers:

- request-wide ``KeyExtras`` (a LoRA adapter, a cache salt; also multimodal hashes for
  callers that only know them request-wide), folded into the chain seed, so they change
  every page of the request;
- per-page extras, ``page_extras`` (page index -> tuple of strings: e.g. the identifiers
  of the multimodal inputs that overlap that page), folded into that page's key only, so
  pages before the first one with extras are shared with a request without them.

``KeyChain`` holds the chain state of one growing sequence and hashes only the pages each
call fills, for callers (the vLLM scheduler) that must not re-hash a long prefix every call.

H is blake2b with a 16-byte digest. Each use has its own ``person`` tag (namespace, full
page, tail page, each with and without per-page extras, request extras) so a tail key can
never equal a full-page key or a seed, and every variable-length field is length-prefixed
so field boundaries cannot be shifted. Without extras, a page's key is what it was before
per-page extras existed.
"""

from __future__ import annotations

import functools
import hashlib
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

# 2: the rank left the namespace seed (keys stored under 1 mean something else).
# 3: vLLM's connector derives page keys from vLLM's SHA-256 block hashes
#    (sparkcache.vllm.block_hash_keys): pages stored under 2 miss rather than meet keys
#    made another way.
FORMAT_VERSION = 3
KEY_BYTES = 16
KEY_HEX_LEN = 2 * KEY_BYTES

_PERSON_NAMESPACE = b"sparkcache-ns"
_PERSON_PAGE = b"sparkcache-page"
_PERSON_TAIL = b"sparkcache-tail"
_PERSON_PAGE_X = b"sparkcache-pagex"
_PERSON_TAIL_X = b"sparkcache-tailx"
_PERSON_EXTRAS = b"sparkcache-xtra"
# Tokens are hashed as little-endian int64 whatever the caller's dtype, so a list of ints
# and an int32 or int64 numpy array of the same values give the same key.
_TOKEN_DTYPE = np.dtype("<i8")
_TOKEN_BYTES = _TOKEN_DTYPE.itemsize
_U64 = struct.Struct("<Q")
# Copying a keyed hash object is about twice as fast as making one with its ``person``.
_PAGE_HASH = hashlib.blake2b(digest_size=KEY_BYTES, person=_PERSON_PAGE)

_HEX_RE = re.compile(r"[0-9a-f]+")

PageExtras = Mapping[int, Sequence[str]]
"""Per-page key material: page index (from 0, in the whole sequence) -> strings. An empty
sequence is the same as no entry."""


def require_hex(value: object, what: str, length: int | None = KEY_HEX_LEN) -> str:
    """Return ``value`` if it is a lowercase hex digest of ``length`` chars, else ValueError.

    Store file names are built only from values that passed this check, so a key can never
    carry a path separator, a dot-dot or a NUL.
    """
    ok = isinstance(value, str) and _HEX_RE.fullmatch(value) is not None
    if ok and length is not None:
        ok = len(value) == length
    if not ok:
        size = f"{length} " if length is not None else ""
        raise ValueError(
            f"{what} {value!r} is not a hex digest: expected {size}lowercase hex "
            f"characters [0-9a-f]"
        )
    return value  # type: ignore[return-value]


def split_keys(keys: Sequence[str], what: str = "page key") -> np.ndarray:
    """The (n, 2) little-endian u64 halves of ``keys``, as rings carry them; ValueError
    (naming the first bad key) unless every key is ``KEY_HEX_LEN`` lowercase hex
    characters. Checked for the batch at once: ``require_hex`` per key costs more than the
    rest of a publication."""
    n = len(keys)
    try:
        joined = "".join(keys)
        ok = (set(map(len, keys)) <= {KEY_HEX_LEN} and joined == joined.lower()
              and len(raw := bytes.fromhex(joined)) == n * KEY_BYTES)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        for key in keys:
            require_hex(key, what)
        raise ValueError(f"{what}s: expected {KEY_HEX_LEN} lowercase hex characters each")
    return np.frombuffer(raw, "<u8").reshape(n, 2)


def require_keys(keys: Sequence[str], what: str = "page key") -> list[str]:
    """``keys`` as a list, checked as ``split_keys`` checks them (one batch, the first bad
    key named): where a 300k-token prompt's 18,750 keys are checked every turn."""
    keys = list(keys)
    split_keys(keys, what)
    return keys


def keys_bytes(keys: Sequence[str]) -> bytes:
    """The raw bytes of page ``keys`` (``KEY_BYTES`` each, in order), as ``key_halves``
    takes them: the vLLM scheduler side sends keys so, and the worker side then neither
    parses nor checks hex on the engine's step. ValueError (as ``split_keys``) unless
    every key is ``KEY_HEX_LEN`` lowercase hex characters."""
    return split_keys(keys).tobytes()


def key_halves(keys: Sequence[str] | bytes, what: str = "page key") -> np.ndarray:
    """``split_keys`` of hex ``keys``, or a view of keys given as their raw bytes
    (``keys_bytes``): any ``KEY_BYTES`` bytes are a key, so only the length is checked."""
    if not isinstance(keys, bytes):
        return split_keys(keys, what)
    if len(keys) % KEY_BYTES:
        raise ValueError(f"{what}s as bytes: expected a multiple of {KEY_BYTES} bytes, "
                         f"got {len(keys)}")
    return np.frombuffer(keys, "<u8").reshape(-1, 2)


def _field(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


@dataclass(frozen=True)
class Namespace:
    """Everything that makes the bytes of a page mean something; part of every key.

    ``rank`` is not: see the module doc. It is validated, but neither hashed nor compared.
    """

    model_id: str
    dtype: str
    kv_layout: str
    tp_size: int
    rank: int = field(compare=False)
    page_tokens: int
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        for name in ("model_id", "dtype", "kv_layout"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(
                    f"{name} {value!r} must be a non-empty string"
                    + (": the model's identity (name and revision), given explicitly"
                       if name == "model_id" else "")
                )
        if self.tp_size < 1:
            raise ValueError(f"tp_size {self.tp_size!r} must be >= 1")
        if not 0 <= self.rank < self.tp_size:
            raise ValueError(f"rank {self.rank!r} must be in [0, tp_size={self.tp_size})")
        if self.page_tokens < 1:
            raise ValueError(f"page_tokens {self.page_tokens!r} must be >= 1")

    def seed(self) -> bytes:
        """The 16-byte chain seed ``h_{-1}`` of this namespace (the rank is not in it)."""
        return self._seed

    @functools.cached_property
    def _seed(self) -> bytes:
        # Once per namespace: vLLM's scheduler starts a key chain for every request it
        # admits, and hashed each time the seed cost 1.8 µs warm, twice per request.
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=_PERSON_NAMESPACE)
        for text in (self.model_id, self.dtype, self.kv_layout):
            h.update(_field(text.encode("utf-8")))
        for number in (self.tp_size, self.page_tokens, self.format_version):
            h.update(_U64.pack(number))
        return h.digest()


@dataclass(frozen=True)
class KeyExtras:
    """Request-wide key material beyond the tokens: two requests share pages only if these
    are equal too. ``None`` / ``()`` mean absent; an empty string is a value.

    - ``adapter``: the LoRA adapter the request runs with (for vLLM, its name and path).
    - ``mm_hashes``: hashes of the request's multimodal inputs, in prompt order.
    - ``cache_salt``: an opaque salt (vLLM's ``cache_salt``), e.g. per tenant.

    They are folded into the chain seed, so every page of such a request differs from the
    same tokens without them. That is what vLLM does with an adapter (in every block's
    hash) and a salt (in the first block's, then chained). For multimodal inputs it is
    conservative (a prefix before an image is not shared with a text-only request); give
    them per page (``page_extras``) to share exactly what vLLM shares.
    """

    adapter: str | None = None
    mm_hashes: tuple[str, ...] = ()
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        hashes = self.mm_hashes
        if isinstance(hashes, str | bytes) or not all(isinstance(h, str) for h in hashes):
            raise ValueError(f"mm_hashes {hashes!r} must be a sequence of strings")
        object.__setattr__(self, "mm_hashes", tuple(hashes))
        for name in ("adapter", "cache_salt"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} {value!r} must be a string or None")

    def empty(self) -> bool:
        return self.adapter is None and not self.mm_hashes and self.cache_salt is None

    def fold(self, seed: bytes) -> bytes:
        """The chain seed of a request with these extras under namespace seed ``seed``:
        ``seed`` itself when there are none, so a plain request's keys do not change.
        Each present field goes in as its kind tag and its length-prefixed value, so
        extras of different kinds (salt "a", adapter "a") never give the same seed."""
        if self.empty():
            return seed
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=_PERSON_EXTRAS)
        h.update(seed)
        if self.adapter is not None:
            h.update(_field(b"adapter") + _field(self.adapter.encode("utf-8")))
        if self.mm_hashes:
            h.update(_field(b"mm") + _U64.pack(len(self.mm_hashes)))
            for value in self.mm_hashes:
                h.update(_field(value.encode("utf-8")))
        if self.cache_salt is not None:
            h.update(_field(b"salt") + _field(self.cache_salt.encode("utf-8")))
        return h.digest()


def chain_seed(namespace: Namespace, extra: KeyExtras | None = None) -> bytes:
    """``h_{-1}`` of a request: the namespace seed with the request's extras folded in."""
    seed = namespace.seed()
    return seed if extra is None else extra.fold(seed)


@dataclass(frozen=True)
class SequenceKeys:
    """Keys of one token sequence: one per full page, plus the tail's if there is one."""

    pages: tuple[str, ...]
    tail: str | None

    def all(self) -> tuple[str, ...]:
        """Full-page keys followed by the tail key: the order pages are stored in a root."""
        return self.pages + ((self.tail,) if self.tail is not None else ())


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"tokens must be a 1-D sequence of integers, got dtype {arr.dtype}")
    return arr.astype(_TOKEN_DTYPE, copy=False)


def _page_extras(page_extras: PageExtras | None) -> dict[int, tuple[str, ...]]:
    """``page_extras`` checked, as a dict without empty entries."""
    if not page_extras:
        return {}
    out: dict[int, tuple[str, ...]] = {}
    for index, values in page_extras.items():
        if isinstance(index, bool) or not isinstance(index, int | np.integer) or index < 0:
            raise ValueError(f"page_extras index {index!r} must be an int >= 0")
        if isinstance(values, str | bytes) or not all(isinstance(v, str) for v in values):
            raise ValueError(
                f"page_extras[{index}] {values!r} must be a sequence of strings"
            )
        if values:
            out[int(index)] = tuple(values)
    return out


def _hash_extra_page(prev: bytes, data: bytes, extras: tuple[str, ...], person: bytes) -> bytes:
    """A page (or tail) with per-page extras: its own person, then the extras as a count
    and each value length-prefixed after the (length-prefixed) tokens."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=person)
    h.update(prev)
    h.update(_U64.pack(len(data) // _TOKEN_BYTES))
    h.update(data)
    h.update(_U64.pack(len(extras)))
    for value in extras:
        h.update(_field(value.encode("utf-8")))
    return h.digest()


def _hash_pages(
    prev: bytes, data: bytes, page_tokens: int, first: int,
    extras: Mapping[int, tuple[str, ...]], out: list[str],
) -> bytes:
    """Hash the full pages of ``data`` (int64 tokens), the first being page ``first`` of
    the sequence, after chain state ``prev``; append their hex keys to ``out`` and return
    the new chain state. Bytes past the last full page are ignored."""
    step = page_tokens * _TOKEN_BYTES
    count = _U64.pack(page_tokens)
    copy, append = _PAGE_HASH.copy, out.append
    stop = len(data) - step + 1
    if not extras:
        for off in range(0, stop, step):
            h = copy()
            h.update(prev)
            h.update(count)
            h.update(data[off : off + step])
            prev = h.digest()
            append(prev.hex())
        return prev
    index = first
    for off in range(0, stop, step):
        page_extra = extras.get(index)
        if page_extra:
            prev = _hash_extra_page(prev, data[off : off + step], page_extra, _PERSON_PAGE_X)
        else:
            h = copy()
            h.update(prev)
            h.update(count)
            h.update(data[off : off + step])
            prev = h.digest()
        append(prev.hex())
        index += 1
    return prev


def _tail_key(prev: bytes, data: bytes, extras: tuple[str, ...] | None) -> str:
    if extras:
        return _hash_extra_page(prev, data, extras, _PERSON_TAIL_X).hex()
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=_PERSON_TAIL)
    h.update(prev)
    h.update(_U64.pack(len(data) // _TOKEN_BYTES))
    h.update(data)
    return h.digest().hex()


def sequence_keys(
    namespace: Namespace, tokens: Sequence[int] | np.ndarray, extra: KeyExtras | None = None,
    page_extras: PageExtras | None = None,
) -> SequenceKeys:
    """Chained keys of ``tokens`` under ``namespace``, the request's ``extra`` and its
    ``page_extras``; the tail is the last partial page (its extras are those of its page
    index)."""
    data = _token_bytes(tokens).tobytes()
    extras = _page_extras(page_extras)
    step = namespace.page_tokens
    full = len(data) // (step * _TOKEN_BYTES)
    keys: list[str] = []
    prev = _hash_pages(chain_seed(namespace, extra), data, step, 0, extras, keys)
    tail = None
    rest = data[full * step * _TOKEN_BYTES :]
    if rest:
        tail = _tail_key(prev, rest, extras.get(full))
    return SequenceKeys(pages=tuple(keys), tail=tail)


class KeyChain:
    """The chain state of one growing token sequence: ``extend`` hashes only the pages it
    fills; tokens past the last full page wait for the next call.

    ``keys`` is the live list of full-page keys (hex), appended to in place and never
    otherwise changed: callers may hold it but must not modify it. After any sequence of
    ``extend`` calls, ``keys`` equals ``sequence_keys(...).pages`` of all tokens given so
    far (with the same extras) and ``tail_key()`` its ``tail``.

    Per-page extras may be given with any call up to and including the one that fills the
    page (a later value for the same page replaces an earlier one); extras for a page
    already hashed are a ValueError.
    """

    __slots__ = ("_extras", "_keys", "_prev", "_tail", "namespace", "page_tokens")

    def __init__(self, namespace: Namespace, extra: KeyExtras | None = None) -> None:
        self.namespace = namespace
        self.page_tokens = namespace.page_tokens
        self._prev = chain_seed(namespace, extra)
        self._keys: list[str] = []
        self._tail = b""
        self._extras: dict[int, tuple[str, ...]] = {}

    @property
    def keys(self) -> list[str]:
        """Full-page keys so far, as the live list (do not modify)."""
        return self._keys

    def pages(self) -> tuple[str, ...]:
        """A copy of the full-page keys."""
        return tuple(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def num_tokens(self) -> int:
        """Tokens given so far, including those waiting for their page to fill."""
        return len(self._keys) * self.page_tokens + len(self._tail) // _TOKEN_BYTES

    @property
    def state(self) -> bytes:
        """The chain state after the last full page (the seed if there is none)."""
        return self._prev

    def extend(self, tokens: Sequence[int] | np.ndarray,
               page_extras: PageExtras | None = None) -> int:
        """Add ``tokens``; hash the pages they fill. Returns how many pages were added."""
        extras = _page_extras(page_extras)
        if extras:
            done = len(self._keys)
            early = [i for i in extras if i < done]
            if early:
                raise ValueError(
                    f"page_extras for page(s) {sorted(early)} already hashed "
                    f"({done} full pages): give a page's extras by the call that fills it"
                )
            self._extras.update(extras)
        data = _token_bytes(tokens).tobytes()
        if self._tail:
            data = self._tail + data
        step = self.page_tokens * _TOKEN_BYTES
        full = len(data) // step
        if full:
            first = len(self._keys)
            self._prev = _hash_pages(self._prev, data, self.page_tokens, first,
                                     self._extras, self._keys)
            if self._extras:
                for index in range(first, first + full):
                    self._extras.pop(index, None)
        self._tail = data[full * step :]
        return full

    def adopt(self, keys: Sequence[str], count: int | None = None) -> None:
        """Take the keys of pages ``len(self)..count-1`` from ``keys[:count]`` (all of
        ``keys`` by default), the keys of a sequence known to hold the same tokens and
        extras as this one up to its page ``count-1``; its first ``len(self)`` keys must be
        this chain's. ``keys`` is not copied beyond what is taken. Only between pages:
        with tokens waiting for their page, ValueError."""
        count = len(keys) if count is None else count
        if not 0 <= count <= len(keys):
            raise ValueError(f"adopt: count {count} out of range for {len(keys)} keys")
        have = len(self._keys)
        if count <= have:
            return
        if self._tail:
            raise ValueError("adopt: tokens are waiting for a page; adopt only between pages")
        if have and keys[have - 1] != self._keys[-1]:
            raise ValueError(f"adopt: page {have - 1} differs: not the same sequence")
        last = require_hex(keys[count - 1], "adopted key")
        self._keys.extend(keys[have:count])
        self._prev = bytes.fromhex(last)
        if self._extras:
            for index in [i for i in self._extras if i < count]:
                del self._extras[index]

    def tail_key(self) -> str | None:
        """The key of the tokens waiting for their page (``sequence_keys(...).tail``)."""
        if not self._tail:
            return None
        return _tail_key(self._prev, self._tail, self._extras.get(len(self._keys)))
