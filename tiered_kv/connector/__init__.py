"""The engine-neutral connector: a torch-free scheduler half and a worker half over one store.

``tiered_kv.connector.scheduler`` and ``.meta`` never import torch; the worker half, the store
and :class:`TieredKVConnector` (both halves in one object) are imported on first use.
"""

from tiered_kv.connector.meta import ConnectorMeta, LoadSpec, SaveSpec

__all__ = ["TieredKVConnector", "build_connector", "ConnectorMeta", "LoadSpec", "SaveSpec"]


def __getattr__(name: str):
    if name in ("TieredKVConnector", "build_connector"):
        from tiered_kv.connector import connector

        return getattr(connector, name)
    raise AttributeError(name)
