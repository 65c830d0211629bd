"""Page keys derived from vLLM's own block hashes, where those are cryptographic.

vLLM hashes every full block of a request for its prefix cache when the request is added
(``request.block_hashes``; ``vllm.v1.core.kv_cache_utils.get_request_block_hasher``):
block ``i``'s hash is ``H(hash of block i-1, tokens of block i, extra keys of block i)``
from ``NONE_HASH``, the extra keys holding the LoRA adapter, the multimodal inputs, the
cache salt and the prompt embeddings. With ``H`` SHA-256 (``--prefix-caching-hash-algo``
``sha256``, vLLM's default, or ``sha256_cbor``) equal hashes mean equal tokens and extra
keys in every block up to there, which is exactly what a page key must stand for. Page
``p``'s key is then

    key_p = trunc16(hash of the last vLLM block of page p)  XOR  seed

with ``seed = blake2b-128(person=b"sparkcache-vllmh", chain seed || algorithm)``, the
chain seed being the namespace's with the request-wide extras folded in
(``identity.chain_seed``). One XOR over all pages at once (numpy) instead of a hash per
page in Python: 0.7-3 µs a page of the scheduler's time (12.5-63 ms for a 300k-token
prompt) becomes under 0.1 (scripts/bench_keys.py).

Why that is as strong as the keys hashed from the tokens (128-bit blake2b): within one
seed the map is a bijection of 128-bit SHA-256 truncations, so two pages share a key
exactly when their truncated hashes collide (2^64 work); across seeds (another model,
layout, salt, format) a shared key needs two hashes whose truncations differ by a given
value, which for SHA-256 is no easier than a collision. And key ``p`` still identifies
the whole prefix ``0..p``, which the store's lookups rely on (``chained_prefix``).

Never with a non-cryptographic hash (xxhash): there a collision, which can be made, would
serve one request's KV to another from a durable store shared by every later engine.
``key_source`` says which keys a connector uses, and why.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sparkcache.identity import KEY_BYTES

CRYPTOGRAPHIC = ("sha256", "sha256_cbor")
HASH_BYTES = 32  # SHA-256
_PERSON_DERIVED = b"sparkcache-vllmh"
_WORDS = KEY_BYTES // 8


@dataclass(frozen=True)
class KeySource:
    """How a connector keys pages: from vLLM's block hashes (``algo``, one of
    ``CRYPTOGRAPHIC``) or, with ``algo`` None, from the tokens (``identity.KeyChain``);
    ``memo``: whether the ``KeyMemo`` may stand a vLLM hash for a key (only where the
    hash is cryptographic, for the same reason). ``why``: for the log line."""

    algo: str | None
    memo: bool
    why: str


def key_source(hash_algo: str | None, hash_block_size: int | None, page_tokens: int,
               lookahead_tokens: int) -> KeySource:
    """The keys a connector under this vLLM hashing uses. Call it once vLLM has made its
    ``NONE_HASH`` (after the engine core's scheduler, which makes the connector)."""
    if hash_algo not in CRYPTOGRAPHIC:
        return KeySource(None, False, f"vLLM's prefix-caching hash {hash_algo!r} is not "
                         f"collision resistant (keys come from {' or '.join(CRYPTOGRAPHIC)} "
                         f"only)")
    broken = _none_hash_mismatch(hash_algo)
    if broken:
        return KeySource(None, False, broken)
    if not hash_block_size or page_tokens % hash_block_size:
        return KeySource(None, True, f"vLLM hashes blocks of {hash_block_size} tokens, "
                         f"which do not divide a page of {page_tokens}")
    if lookahead_tokens:
        return KeySource(None, True, f"vLLM's block hashes cover {lookahead_tokens} tokens "
                         f"past their block")
    return KeySource(hash_algo, True, f"from vLLM's {hash_algo} block hashes "
                     f"({page_tokens // hash_block_size} a page)")


def _none_hash_mismatch(hash_algo: str) -> str | None:
    """Why this process's block hashes may not be ``hash_algo``'s, or None: vLLM's
    ``NONE_HASH`` must be what that algorithm makes of vLLM's seed for it."""
    try:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils

        seed = kv_cache_utils.get_none_hash_seed()
        made = getattr(kv_cache_utils, "NONE_HASH", None)
        if made is not None and made == get_hash_fn_by_name(hash_algo)(seed):
            return None
    except Exception as exc:  # an older or newer vLLM than these names
        return f"vLLM's NONE_HASH could not be checked ({exc!r})"
    return f"vLLM's NONE_HASH is not {hash_algo}'s of its seed"


def derived_seed(chain_seed: bytes, algo: str) -> bytes:
    """The 16 bytes a request's derived keys are XORed with (module doc)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=_PERSON_DERIVED)
    h.update(chain_seed)
    h.update(algo.encode("ascii"))
    return h.digest()


def derive(seed: bytes, hashes: Sequence[bytes], blocks_per_page: int, first: int,
           stop: int) -> bytes:
    """Raw keys (``KEY_BYTES`` each) of pages ``first..stop-1`` from vLLM's block hashes
    of the request, ``blocks_per_page`` of them a page. ValueError unless each hash is
    ``HASH_BYTES`` long."""
    n = stop - first
    if n <= 0:
        return b""
    k = blocks_per_page
    joined = b"".join(hashes[(first + 1) * k - 1 : stop * k : k])
    if len(joined) != n * HASH_BYTES:
        raise ValueError(f"vLLM block hashes: {len(joined)} bytes for {n} pages, expected "
                         f"{HASH_BYTES} a page")
    words = np.frombuffer(joined, "<u8").reshape(n, HASH_BYTES // 8)[:, :_WORDS]
    return (words ^ np.frombuffer(seed, "<u8")).tobytes()


class PageKeys(Sequence[str]):
    """Page keys held as their raw bytes (``KEY_BYTES`` a page), only ever appended to:
    what the workers take (``PageJob.keys``) as it is, and read as hex one key at a time
    where the store's index wants text (a lookup reads a handful). Making 18,750 hex
    strings for a 300k-token prompt would cost more than deriving its keys.

    A slice is a view of the same bytes (pages are never changed, only added)."""

    __slots__ = ("_raw", "_start", "_stop")

    def __init__(self, raw: bytearray | None = None, start: int = 0,
                 stop: int | None = None) -> None:
        self._raw = bytearray() if raw is None else raw
        self._start = start
        self._stop = stop  # None: up to the last page, as the owner grows

    def __len__(self) -> int:
        end = len(self._raw) // KEY_BYTES if self._stop is None else self._stop
        return end - self._start

    def __getitem__(self, index):  # type: ignore[override]
        n = len(self)
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step != 1:
                raise ValueError(f"PageKeys slice step {step}: only 1")
            return PageKeys(self._raw, self._start + start, self._start + max(start, stop))
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"page key {index} of {n}")
        at = (self._start + index) * KEY_BYTES
        return self._raw[at : at + KEY_BYTES].hex()

    def raw(self, start: int = 0, stop: int | None = None) -> bytes:
        """The raw keys of pages ``start..stop-1`` of this view."""
        stop = len(self) if stop is None else min(stop, len(self))
        base = self._start * KEY_BYTES
        return bytes(self._raw[base + start * KEY_BYTES : base + max(start, stop) * KEY_BYTES])

    def append_raw(self, data: bytes) -> None:
        """Add keys at the end (only to the owner, not to a view)."""
        if self._start or self._stop is not None:
            raise ValueError("PageKeys: a view cannot grow")
        self._raw += data


class DerivedChain:
    """``identity.KeyChain``'s part in ``RequestKeys`` for derived keys: the keys of one
    request's full pages so far, from its vLLM block hashes."""

    __slots__ = ("_keys", "seed")

    def __init__(self, chain_seed: bytes, algo: str) -> None:
        self.seed = derived_seed(chain_seed, algo)
        self._keys = PageKeys()

    @property
    def keys(self) -> PageKeys:
        """Full-page keys so far, as the live sequence."""
        return self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def extend(self, hashes: Sequence[bytes], blocks_per_page: int, stop: int) -> None:
        """Derive the keys of the pages from the next one to ``stop - 1``."""
        self._keys.append_raw(derive(self.seed, hashes, blocks_per_page, len(self), stop))

    def adopt(self, keys: PageKeys, count: int) -> None:
        """Take pages ``len(self)..count-1`` from ``keys``, those of a request known to
        hold the same pages up to ``count - 1``; ValueError if the last page this chain
        has differs from theirs."""
        have = len(self)
        if count <= have:
            return
        if have and keys.raw(have - 1, have) != self._keys.raw(have - 1, have):
            raise ValueError(f"adopt: page {have - 1} differs: not the same sequence")
        self._keys.append_raw(keys.raw(have, count))
