"""Sharing pages with the cluster and fetching them back, pipelined.

``share`` sends each page once fleet-wide: it asks which of a batch the cluster holds
(one pipelined ``EXISTS`` per page, grouped by node), then sets the others only if still
absent (``SET NX``: a page another node sent meanwhile is not overwritten, and counts as
present). ``fetch`` reads a prefix of pages (pipelined ``GET``s) and verifies each as a
local read does (``codec.decode``): it ends at the first page missing or bad, whose
successors are then computed, never served.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sparkcache.fleet import codec
from sparkcache.fleet.cluster import page_name
from sparkcache.ratelog import RateLimitedLog
from sparkcache.store.records import Buffer

log = logging.getLogger(__name__)
# A page planted or damaged under a right name is refetched by every lookup that reaches it.
_rare = RateLimitedLog(log)


@dataclass
class ShareResult:
    sent: int = 0  # pages this call stored in the cluster
    present: int = 0  # pages the cluster held already (or another node stored meanwhile)
    bytes_sent: int = 0


@dataclass
class FetchResult:
    pages: list[memoryview] = field(default_factory=list)  # the verified prefix, in order
    missing: int | None = None  # index of the first page not in the cluster, if any
    bad: int | None = None  # index of the first page that failed verification, if any
    reason: str = ""  # why it failed


def share(cluster: Any, prefix: str, pages: Sequence[tuple[bytes, Buffer]]) -> ShareResult:
    """Store ``pages`` (raw key, payload) the cluster does not hold. Raises redis' errors
    where the cluster fails (the caller backs off and tries again later)."""
    result = ShareResult()
    if not pages:
        return result
    names = [page_name(prefix, key) for key, _ in pages]
    pipe = cluster.pipeline(transaction=False)
    for name in names:
        pipe.exists(name)
    held = pipe.execute()
    absent = [i for i, n in enumerate(held) if not n]
    result.present = len(pages) - len(absent)
    if not absent:
        return result
    pipe = cluster.pipeline(transaction=False)
    values = []
    for i in absent:
        value = codec.encode(pages[i][0], pages[i][1])
        values.append(len(value))
        pipe.set(names[i], value, nx=True)
    for stored, size in zip(pipe.execute(), values, strict=True):
        if stored:
            result.sent += 1
            result.bytes_sent += size
        else:
            result.present += 1
    return result


def fetch(cluster: Any, prefix: str, keys: Sequence[bytes]) -> FetchResult:
    """The longest verified prefix of ``keys``' pages. Raises redis' errors where the
    cluster fails: the caller counts it a miss (nothing of a failed read is served)."""
    result = FetchResult()
    if not keys:
        return result
    pipe = cluster.pipeline(transaction=False)
    for key in keys:
        pipe.get(page_name(prefix, key))
    for i, (key, value) in enumerate(zip(keys, pipe.execute(), strict=True)):
        if value is None:
            result.missing = i
            return result
        try:
            result.pages.append(codec.decode(key, value))
        except codec.BadSharedPage as exc:
            result.bad, result.reason = i, str(exc)
            _rare.warning("bad", "shared page %s refused: %s", key.hex(), exc)
            return result
    return result

