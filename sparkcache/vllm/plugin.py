"""vLLM's plugin hook (entry point group ``vllm.general_plugins``): registers
``SparkCacheConnector`` by name with vLLM's connector factory, so
``--kv-transfer-config '{"kv_connector": "SparkCacheConnector", ...}'`` loads it with no
``kv_connector_module_path``. vLLM runs general plugins in each of its processes, maybe
more than once, and does not guard the call: registering again is a no-op, and a fault
is logged, never raised (vLLM then serves without the connector, or names it unknown)."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

CONNECTOR_NAME = "SparkCacheConnector"


def register() -> None:
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        # Lazily: the connector's module is imported only when a config names it.
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "sparkcache.vllm.connector", CONNECTOR_NAME)
    except ValueError:
        pass  # registered already: this process loaded its plugins before
    except Exception:
        log.exception("SparkCache: registering %s with vLLM failed", CONNECTOR_NAME)
