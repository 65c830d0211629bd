"""The stores lanes start from: a store as time at its cap leaves it (``age_store``,
``InlineStore.age``), filled to its low watermark with conversations that ended before
the soak began; and the restore-only lane's, seeded with what its conversations will
ask for (``seed_store``).

The original report's lanes had sat at their cap for an hour when the after-probes ran.
What the predecessor's maintenance costs grows with what the store holds: every pass
reads and sorts every root, and it kept one root per request, so a conversation of T
turns left T roots, each listing the whole prefix of its turn. A soak of minutes on an
empty store meets it at a fraction of that size, and showed no slowdown. So every
read-write lane starts from the same inventory: conversations of the soak's own shape
(an opening of ``context_min`` tokens, then tails of ``tail_tokens``, ended anywhere up
to ``context_max``), written as each design leaves them: SparkCache one root per
conversation (a turn's root supersedes the one before it), the inline model one root
per turn. Their token streams are their own, so nothing asks for their pages: eviction
takes them first, least recently used, and the soak's own conversations keep their
prefixes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sparkcache.identity import KeyChain, Namespace
from sparkcache.soak import engine as engine_mod
from sparkcache.soak.pages import page_content
from sparkcache.soak.params import SoakParams
from sparkcache.soak.workload import VOCAB, first_context
from sparkcache.store import PageStore
from sparkcache.store.records import PageData, Root

# Conversation numbers of aged conversations: far above the soak's own, so their token
# streams never meet.
AGED_BASE = 1_000_000


@dataclass(frozen=True)
class AgedConversation:
    index: int
    keys: list[str]  # its pages, in order
    turn_ends: list[int]  # pages held after each of its turns; the last is len(keys)


def aged_conversations(params: SoakParams, ns: Namespace) -> Iterator[AgedConversation]:
    """The aged conversations, oldest first, while their pages fit under the low
    watermark."""
    budget = params.low_watermark_bytes // engine_mod.page_bytes(params.page_tokens)
    lengths = np.random.default_rng([params.seed, AGED_BASE])
    index = 0
    while True:
        conv = AGED_BASE + index
        chain = KeyChain(ns)
        chain.extend(first_context(params, conv, 0))
        ends = [len(chain.keys)]
        length = int(lengths.integers(params.context_min, params.context_max + 1))
        tails = np.random.default_rng([params.seed, conv, 0, 1])
        while chain.num_tokens + params.tail_tokens <= length:
            chain.extend(tails.integers(0, VOCAB, params.tail_tokens))
            ends.append(len(chain.keys))
        if len(chain.keys) > budget:
            return
        budget -= len(chain.keys)
        yield AgedConversation(index, list(chain.keys), ends)
        index += 1


def age_store(store_dir: Path, params: SoakParams, ns: Namespace) -> int:
    """Commit the aged conversations into a SparkCache store, one root each, their
    leases long expired; the bytes written."""
    nbytes = engine_mod.page_bytes(params.page_tokens)
    written = 0
    with PageStore(store_dir, 0, lease_seconds=0.0) as store:
        for conv in aged_conversations(params, ns):
            _commit(store, f"aged-{conv.index}", conv.keys, nbytes)
            written += len(conv.keys) * nbytes
    return written


def seed_store(store_dir: Path, params: SoakParams, ns: Namespace) -> int:
    """Fill a restore-only lane's store (up to its low watermark) with the opening
    prompts its conversations will send, as an earlier read-write run would have left
    it; the bytes written."""
    nbytes = engine_mod.page_bytes(params.page_tokens)
    written = 0
    with PageStore(store_dir, 0) as store:
        for generation in range(64):
            for conv in range(params.conversations):
                chain = KeyChain(ns)
                chain.extend(first_context(params, conv, generation))
                size = len(chain.keys) * nbytes
                if written + size > params.low_watermark_bytes:
                    return written
                _commit(store, f"seed-{conv}-{generation}", chain.keys, nbytes)
                written += size
    return written


def _commit(store: PageStore, name: str, keys: list[str], nbytes: int) -> None:
    """One root of ``keys``, its pages derived from them (``soak.pages``)."""
    root_id = hashlib.blake2b(name.encode(), digest_size=16).hexdigest()
    store.commit(Root(root_id, [PageData(k, page_content(k, nbytes)) for k in keys]))
