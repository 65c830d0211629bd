"""The lookup half of the read-through: how far the cluster holds a request's prefix past
what the local stores hold, asked off the scheduler's thread.

vLLM's scheduler asks about a request at every step while it waits; a round trip to the
cluster must not stall that thread, which keeps the engine fed. So the first ask starts
the cluster's probes (``pages.held``) on this object's own thread and waits for them,
``INLINE_WAIT_S`` at most in all the asks of one scheduler step (``new_step``): a round
trip or two on a LAN, within which the answer for a prompt the cluster lacks (one round)
comes, so that request is not put off a step. If they are not done, it answers "not
known yet" (the connector answers vLLM "ask again later"), and a later ask takes the
answer.
The probes end by ``timeout_s`` with what they found so far, and an answer still not in
by then counts as none (``late``): the request computes rather than wait on a slow
cluster. A cluster that fails is not asked for a back-off (``ClusterLink``): requests
then get no cluster pages at once.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from sparkcache.fleet.cluster import ClusterSettings
from sparkcache.fleet.link import ClusterLink
from sparkcache.fleet.pages import held
from sparkcache.identity import KEY_BYTES

log = logging.getLogger(__name__)

# Answers kept for requests that have not asked again yet (a request that is dropped
# never asks again: the oldest go).
KEPT = 1024
# How long after its deadline a probe may still answer (a socket's own time-out ends it).
GRACE_S = 0.05
# How long the asks of one scheduler step may wait for probes, in all, before answering
# "later": a burst of new requests must not stall the step once per request.
INLINE_WAIT_S = 0.002


@dataclass
class _Asked:
    start: int  # the page the probes began at
    count: int  # pages asked about
    deadline: float
    future: Future


class ClusterLookup:
    def __init__(self, settings: ClusterSettings, ranks: int, timeout_s: float) -> None:
        """``ranks``: a page counts only where every tensor-parallel rank shared it."""
        self.ranks = ranks
        self.timeout_s = timeout_s
        self.link = ClusterLink(settings, "read-through lookups")
        self._counts: Counter = Counter()  # asked, late, unavailable
        self._asked: OrderedDict[Hashable, _Asked] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sparkcache-fleet-lookup")
        self._wait_left = INLINE_WAIT_S  # of this scheduler step's

    @property
    def counters(self) -> Counter:
        """Lookups asked of the cluster, answered late, answered 0 while backing off
        (unavailable), and the cluster's faults (failed)."""
        return self._counts + Counter(failed=self.link.failures)

    def held(self, request_id: Hashable, keys: bytes, start: int) -> int | None:
        """How many leading pages of ``keys`` (raw, ``KEY_BYTES`` each; the request's
        pages from page ``start`` on) the cluster holds for every rank; None: not known
        yet, ask again. 0 at once while the cluster is failing."""
        count = len(keys) // KEY_BYTES
        asked = self._asked.get(request_id)
        now = time.monotonic()
        if asked is not None and (asked.start, asked.count) == (start, count):
            if asked.future.done():
                del self._asked[request_id]
                return asked.future.result()
            if now < asked.deadline + GRACE_S:
                return None
            del self._asked[request_id]
            self._counts["late"] += 1
            return 0
        if now < self.link.retry_at:
            self._counts["unavailable"] += 1
            return 0
        self._counts["asked"] += 1
        deadline = now + self.timeout_s
        future = self._pool.submit(
            self._probe, [keys[i:i + KEY_BYTES] for i in range(0, len(keys), KEY_BYTES)],
            deadline)
        if self._wait_left > 0:
            began = time.monotonic()
            try:
                return future.result(timeout=self._wait_left)
            except TimeoutError:
                pass
            finally:
                self._wait_left -= time.monotonic() - began
        self._asked[request_id] = _Asked(start, count, deadline, future)
        while len(self._asked) > KEPT:
            self._asked.popitem(last=False)
        return None

    def new_step(self) -> None:
        """The scheduler built a step (``build_connector_meta``): the next step's asks
        may wait ``INLINE_WAIT_S`` again."""
        self._wait_left = INLINE_WAIT_S

    def forget(self, request_id: Hashable) -> None:
        """A request finished: its answer, if one is still kept, is not needed."""
        self._asked.pop(request_id, None)

    def _probe(self, keys: list[bytes], deadline: float) -> int:
        """0 where the cluster failed, or began backing off since this was asked."""
        prefix = self.link.settings.key_prefix
        return self.link.call(
            lambda cluster: held(cluster, prefix, range(self.ranks), keys, deadline)) or 0

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.link.close()
