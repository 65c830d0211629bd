"""What the scheduler side tells the worker sides each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from sparkcache.identity import KEY_BYTES


@dataclass
class PageJob:
    """Pages of request ``req_id`` <-> its vLLM blocks: page ``i``'s key is
    ``keys[KEY_BYTES * i : KEY_BYTES * (i + 1)]`` (raw bytes, ``identity.keys_bytes``: the
    worker side then parses no hex on the engine's step), its block ``block_ids[i]``."""

    req_id: str
    keys: bytes
    block_ids: list[int]
    lease: int = 0  # a load's: the read lease its lookup took, which the load ends

    @property
    def pages(self) -> int:
        return len(self.keys) // KEY_BYTES


@dataclass
class SparkCacheMetadata(KVConnectorMetadata):
    loads: list[PageJob] = field(default_factory=list)
    # Finished requests: vLLM holds their blocks until the worker sides report them.
    # A job may have no pages: the request's saves made while it ran are still copied.
    saves: list[PageJob] = field(default_factory=list)
    # Requests still running: the pages computed so far (``Settings.save_stride_pages``).
    partial: list[PageJob] = field(default_factory=list)
    # Requests preempted at this step: their computed pages, saved by
    # ``handle_preemptions`` before their freed blocks are written (possibly no pages).
    preempted: list[PageJob] = field(default_factory=list)
