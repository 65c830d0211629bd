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
