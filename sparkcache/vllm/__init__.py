"""SparkCache inside vLLM: ``SparkCacheConnector``, known to vLLM by that name through
the package's plugin (``sparkcache.vllm.plugin``), or loaded with
``kv_connector_module_path="sparkcache.vllm"`` (see docs/vllm.md). The only SparkCache
package that imports vLLM."""

from __future__ import annotations

from typing import Any

__all__ = ["SparkCacheConnector"]


def __getattr__(name: str) -> Any:
    # On first use: vLLM imports the plugin module in every process, the connector (with
    # torch and vLLM's connector API) only where a config names it.
    if name == "SparkCacheConnector":
        from sparkcache.vllm.connector import SparkCacheConnector

        return SparkCacheConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
