"""SparkCache inside vLLM: load ``SparkCacheConnector`` with
``kv_connector_module_path="sparkcache.vllm"`` (see docs/vllm.md). The only SparkCache
package that imports vLLM."""

from sparkcache.vllm.connector import SparkCacheConnector

__all__ = ["SparkCacheConnector"]
