"""``vllm.general_plugins`` entry point: registers the connector name ``kvdisk``.

vLLM runs general plugins once in every process it starts (API server, EngineCore,
workers); the API server needs the class too (metrics, config checks).
"""

from __future__ import annotations

CONNECTOR_NAME = "kvdisk"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # The factory raises on a duplicate name; a second call in one process is harmless.
    if CONNECTOR_NAME in getattr(KVConnectorFactory, "_registry", {}):
        return
    try:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "vllm_kvdisk.connector.facade", "KVDiskConnector"
        )
    except ValueError:
        pass
