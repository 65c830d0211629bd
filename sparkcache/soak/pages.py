"""Page contents derived from page keys, so every restored page can be checked byte for
byte. A real engine's KV derives from the prefix; the key names the prefix, so the
engine "computes" a page by deriving its bytes from its key.

``store.testing.page_bytes`` draws a fresh random stream per page (~40 µs for 16 KiB);
the soak derives and checks thousands of pages a second on the engine's core, so it
tiles a 64-byte digest of the key instead: every byte still depends on the key, and a
page of another key, a torn page or a page in the wrong block differs.
"""

from __future__ import annotations

import hashlib

import numpy as np


def page_content(key: str, nbytes: int) -> np.ndarray:
    """The ``nbytes`` bytes of the page with hex key ``key``."""
    digest = np.frombuffer(hashlib.blake2b(key.encode(), digest_size=64).digest(), np.uint8)
    reps = -(-nbytes // digest.size)
    return np.tile(digest, reps)[:nbytes]


def matches(key: str, data: np.ndarray) -> bool:
    """Whether ``data`` (uint8) is exactly the page of ``key``."""
    return bool(np.array_equal(data, page_content(key, data.size)))
