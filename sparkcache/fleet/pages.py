"""Sharing pages with the cluster, finding how far it holds a prefix, fetching them back.

``held`` finds how many leading pages of a prefix the cluster holds for every rank in a
few pipelined rounds of probes (within a deadline, for lookups). Sharing a root is that,
then ``send``: the pages past what the cluster holds, each set only if still absent
(``SET NX``: a page another node sent meanwhile is not overwritten, and counts as
present), so each page is sent once fleet-wide: a conversation's next turn stored on
another node sends only its new pages. ``fetch_into`` reads pages
(pipelined ``GET``s) and verifies each as a local read does (``codec.decode``) before it
copies it to its destination: it ends at the first page missing or bad, whose
successors are then computed, never served.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sparkcache.fleet import codec
from sparkcache.fleet.cluster import page_name
from sparkcache.ratelog import RateLimitedLog
from sparkcache.store.records import Buffer

log = logging.getLogger(__name__)
# A page planted or damaged under a right name is refetched by every load that reaches it.
_rare = RateLimitedLog(log)

# Pages probed in one round of ``held`` (each an EXISTS per rank): three rounds place the
# end of a 300k-token prefix (18,750 pages of 16 tokens) exactly.
PROBES_PER_ROUND = 64


@dataclass
class ShareResult:
    sent: int = 0  # pages this call stored in the cluster
    present: int = 0  # pages the cluster held already (or another node stored meanwhile)
    bytes_sent: int = 0


@dataclass
class FetchResult:
    pages: int = 0  # leading pages verified and copied to their destinations
    bytes: int = 0  # their payload bytes
    missing: int | None = None  # index of the first page not in the cluster, if any
    bad: int | None = None  # index of the first page that failed verification, if any
    reason: str = ""  # why it failed


def send(cluster: Any, prefix: str, rank: int,
         framed: Sequence[tuple[bytes, Buffer]]) -> ShareResult:
    """Set rank ``rank``'s pages ``framed`` (raw key, value made by ``codec.frame`` or
    ``codec.encode``) where the cluster does not hold them (``SET NX``: a page another
    node sent is never overwritten, and counts as present): one pipeline. Raises redis'
    errors where the cluster fails (the caller backs off and sends again later)."""
    result = ShareResult()
    if not framed:
        return result
    pipe = cluster.pipeline(transaction=False)
    sizes = []
    for key, value in framed:
        sizes.append(memoryview(value).nbytes)
        pipe.set(page_name(prefix, rank, key), value, nx=True)
    for stored, size in zip(pipe.execute(), sizes, strict=True):
        if stored:
            result.sent += 1
            result.bytes_sent += size
        else:
            result.present += 1
    return result


def share(cluster: Any, prefix: str, rank: int,
          pages: Sequence[tuple[bytes, Buffer]]) -> ShareResult:
    """Store rank ``rank``'s ``pages`` (raw key, payload: a prefix's, in order) the
    cluster does not hold, as the share worker does a root: how far the cluster holds
    them already (``held``), then the rest (``send``). Raises redis' errors."""
    skip = held(cluster, prefix, (rank,), [key for key, _ in pages])
    result = send(cluster, prefix, rank,
                  [(key, codec.encode(rank, key, payload)) for key, payload in pages[skip:]])
    result.present += skip
    return result


def held(cluster: Any, prefix: str, ranks: Sequence[int], keys: Sequence[bytes],
         deadline: float | None = None) -> int:
    """How many leading ``keys`` the cluster holds for every rank of ``ranks``.

    Probes, not a page-by-page walk: each round asks (one pipeline) about up to
    ``PROBES_PER_ROUND`` pages spread evenly over what is still unknown, and narrows it
    to the gap between the last page found and the first missing. That reads the end of
    a prefix the cluster holds whole, which is how it holds one (share workers send a
    root from its first page, and a fetched prefix is touched, for LRU, as one); a page
    missing in the middle is found by the fetch, which ends there. Past ``deadline``
    (``time.monotonic``), the pages known held so far. Raises redis' errors."""
    lo, hi = 0, len(keys) + 1  # lo pages held; hi pages not (len + 1: impossible)
    while hi - lo > 1:
        span = hi - lo - 1
        # The first page past what is known held among them: a prefix the cluster
        # lacks (a new prompt's) is answered in one round.
        counts = (list(range(lo + 1, hi)) if span <= PROBES_PER_ROUND else
                  sorted({lo + 1} | {lo + span * i // PROBES_PER_ROUND
                                     for i in range(1, PROBES_PER_ROUND + 1)}))
        pipe = cluster.pipeline(transaction=False)
        for count in counts:
            for rank in ranks:
                pipe.exists(page_name(prefix, rank, keys[count - 1]))
        found = pipe.execute()
        n = len(ranks)
        for i, count in enumerate(counts):
            if all(found[i * n : (i + 1) * n]):
                lo = count
            else:
                hi = count
                break
        if deadline is not None and time.monotonic() >= deadline:
            return lo
    return lo


def fetch_into(cluster: Any, prefix: str, rank: int, keys: Sequence[bytes],
               into: Sequence[Any], page_bytes: int) -> FetchResult:
    """Fetch rank ``rank``'s pages ``keys`` (one pipeline), verify each, and copy it into
    ``into`` in order: an entry is one writable buffer, or a list of byte memoryviews
    holding the page in pieces (its KV blocks' runs). Ends at the first page missing,
    failing verification or not ``page_bytes`` long; nothing of that page is copied.
    Raises redis' errors where the cluster fails (the caller counts a miss)."""
    result = FetchResult()
    if not keys:
        return result
    pipe = cluster.pipeline(transaction=False)
    for key in keys:
        pipe.get(page_name(prefix, rank, key))
    for i, (key, value) in enumerate(zip(keys, pipe.execute(), strict=True)):
        if value is None:
            result.missing = i
            return result
        try:
            payload = codec.decode(rank, key, value)
            if payload.nbytes != page_bytes:
                raise codec.BadSharedPage(f"{payload.nbytes} bytes, not the engine's "
                                          f"{page_bytes}")
        except codec.BadSharedPage as exc:
            result.bad, result.reason = i, str(exc)
            _rare.warning("bad", "shared page %s refused: %s", key.hex(), exc)
            return result
        _copy(payload, into[i])
        result.pages += 1
        result.bytes += page_bytes
    return result


def _copy(payload: memoryview, target: Any) -> None:
    if isinstance(target, list):
        at = 0
        for piece in target:
            piece[:] = payload[at : at + piece.nbytes]
            at += piece.nbytes
        return
    memoryview(target).cast("B")[: payload.nbytes] = payload
