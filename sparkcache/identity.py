"""Page identity: a namespace seed and chained, domain-separated page keys.

A page key is ``h_i = H(h_{i-1}, tokens of page i)`` where ``h_{-1}`` is the namespace seed.
Because every key folds in its whole prefix and the namespace, two pages share a key only
if they hold the same tokens after the same prefix, for the same model, dtype, KV layout,
tensor-parallel size, rank, page size and format: keys from another namespace never hit.

H is blake2b with a 16-byte digest. Each use has its own ``person`` tag (namespace, full
page, tail page) so a tail key can never equal a full-page key or a seed, and every
variable-length field is length-prefixed so field boundaries cannot be shifted.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

FORMAT_VERSION = 1
KEY_BYTES = 16
KEY_HEX_LEN = 2 * KEY_BYTES

_PERSON_NAMESPACE = b"sparkcache-ns"
_PERSON_PAGE = b"sparkcache-page"
_PERSON_TAIL = b"sparkcache-tail"
# Tokens are hashed as little-endian int64 whatever the caller's dtype, so a list of ints
# and an int32 or int64 numpy array of the same values give the same key.
_TOKEN_DTYPE = np.dtype("<i8")
_U64 = struct.Struct("<Q")

_HEX_RE = re.compile(r"[0-9a-f]+")


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


def _field(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


@dataclass(frozen=True)
class Namespace:
    """Everything that makes the bytes of a page mean something; part of every key."""

    model_id: str
    dtype: str
    kv_layout: str
    tp_size: int
    rank: int
    page_tokens: int
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size {self.tp_size!r} must be >= 1")
        if not 0 <= self.rank < self.tp_size:
            raise ValueError(f"rank {self.rank!r} must be in [0, tp_size={self.tp_size})")
        if self.page_tokens < 1:
            raise ValueError(f"page_tokens {self.page_tokens!r} must be >= 1")

    def seed(self) -> bytes:
        """The 16-byte chain seed ``h_{-1}`` of this namespace."""
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=_PERSON_NAMESPACE)
        for text in (self.model_id, self.dtype, self.kv_layout):
            h.update(_field(text.encode("utf-8")))
        for number in (self.tp_size, self.rank, self.page_tokens, self.format_version):
            h.update(_U64.pack(number))
        return h.digest()


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


def _chain(prev: bytes, tokens: np.ndarray, person: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=person)
    h.update(prev)
    h.update(_U64.pack(tokens.size))
    h.update(tokens.tobytes())
    return h.digest()


def sequence_keys(namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> SequenceKeys:
    """Chained keys of ``tokens`` under ``namespace``; the tail is the last partial page."""
    arr = _token_bytes(tokens)
    step = namespace.page_tokens
    full = arr.size // step
    prev = namespace.seed()
    keys = []
    for i in range(full):
        prev = _chain(prev, arr[i * step : (i + 1) * step], _PERSON_PAGE)
        keys.append(prev.hex())
    tail = None
    if arr.size % step:
        tail = _chain(prev, arr[full * step :], _PERSON_TAIL).hex()
    return SequenceKeys(pages=tuple(keys), tail=tail)
