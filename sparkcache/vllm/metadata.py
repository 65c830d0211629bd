"""What the scheduler side tells the worker sides each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class PageJob:
    """Pages ``keys[i]`` <-> vLLM block ``block_ids[i]`` of request ``req_id``."""

    req_id: str
    keys: list[str]
    block_ids: list[int]


@dataclass
class SparkCacheMetadata(KVConnectorMetadata):
    loads: list[PageJob] = field(default_factory=list)
    saves: list[PageJob] = field(default_factory=list)
    # Requests that finished (aborted) while their load ran: vLLM holds their blocks
    # until a worker reports them sent, which it does once the load has ended.
    release_after_load: list[str] = field(default_factory=list)
