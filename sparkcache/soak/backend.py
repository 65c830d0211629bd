"""How the soak engine reaches a KV store: the calls vLLM's connector makes, in vLLM's
order (lookup at admission, leased; an async load; a save at finish whose blocks come
back later), without vLLM.

``ServiceBackend`` is what ``sparkcache/vllm/scheduler_side.py`` and ``worker_side.py``
do, from the pieces under them: a leased ``PrefixLookup`` of the keys of the prompt's
full pages but the last token's (``get_num_new_matched_tokens``), ``load_keys`` and
``poll_loads`` (``start_load_kv`` / ``get_finished``), ``publish_keys`` of the computed
full pages at finish and ``poll_completions`` (``request_finished`` / ``get_finished``),
saves only in read-write mode. Those modules import vLLM (its metadata class), so the
soak calls the same pieces directly. ``NullBackend`` is the ``off`` lane.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from sparkcache.client import SparkCacheClient
from sparkcache.config import AccessMode, Config
from sparkcache.prefix_lookup import PrefixLookup


@dataclass
class Polled:
    loads: list[tuple[str, int]] = field(default_factory=list)  # (request, pages loaded)
    released: list[str] = field(default_factory=list)  # saves whose blocks came back


class Backend(Protocol):
    def lookup(self, keys: Sequence[str]) -> int:
        """Leading pages of ``keys`` the store holds, leased until the load."""

    def load(self, req_id: str, keys: Sequence[str], blocks: Sequence[int]) -> bool:
        """Start loading ``keys`` into ``blocks``; False if refused (nothing loads)."""

    def save(self, req_id: str, keys: Sequence[str], blocks: Sequence[int]) -> bool:
        """Publish pages ``keys`` held in ``blocks``; True: the blocks are lent until
        ``poll`` releases ``req_id``."""

    def poll(self) -> Polled: ...

    def skips(self) -> Counter: ...

    def close(self) -> None: ...


class NullBackend:
    """No store: the ``off`` lane."""

    def lookup(self, keys: Sequence[str]) -> int:
        return 0

    def load(self, req_id: str, keys: Sequence[str], blocks: Sequence[int]) -> bool:
        return False

    def save(self, req_id: str, keys: Sequence[str], blocks: Sequence[int]) -> bool:
        return False

    def poll(self) -> Polled:
        return Polled()

    def skips(self) -> Counter:
        return Counter()

    def close(self) -> None:
        pass


class ServiceBackend:
    """SparkCache's worker processes through the client and a leased prefix lookup."""

    def __init__(self, cfg: Config, tensors: list[torch.Tensor], model_id: str) -> None:
        self.cfg = cfg
        self.client = SparkCacheClient(cfg, 0, model_id=model_id)
        if not self.client.register_kv_caches(tensors):
            self.client.close()
            raise RuntimeError("the client refused the KV caches (see the log)")
        self.prefix = PrefixLookup(cfg, 1)
        self._saves = cfg.access_mode is AccessMode.READ_WRITE

    def lookup(self, keys: Sequence[str]) -> int:
        return self.prefix.lookup(keys)

    def load(self, req_id: str, keys: Sequence[str], blocks: Sequence[int]) -> bool:
        return self.client.load_keys(req_id, keys, blocks)

    def save(self, req_id: str, keys: Sequence[str], blocks: Sequence[int]) -> bool:
        if not self._saves or not keys:
            return False
        return self.client.publish_keys(req_id, keys, blocks)

    def poll(self) -> Polled:
        out = Polled()
        for result in self.client.poll_loads():
            pages = result.tokens // self.cfg.page_tokens
            out.loads.append((str(result.load_id), pages))
        out.released = [str(c.seq_id) for c in self.client.poll_completions()]
        self.client.poll_durable()  # keeps the client's bookkeeping of durability short
        return out

    def skips(self) -> Counter:
        out: Counter = Counter()
        for reason, n in self.client.counters.skipped.items():
            out[f"publish_{reason}"] += n
        for reason, n in self.client.counters.misses.items():
            out[f"load_{reason}"] += n
        for reason, n in self.prefix.misses.items():
            out[f"lookup_{reason}"] += n
        for status, n in self.client.counters.load_status.items():
            if status not in ("ok", "partial"):
                out[f"load_status_{status}"] += n
        return out

    def close(self) -> None:
        self.prefix.close()
        self.client.close()
