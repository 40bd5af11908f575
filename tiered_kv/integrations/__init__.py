"""Engine adapters, attached by configuration only.

- :mod:`tiered_kv.integrations.vllm`: ``TieredKVConnector``, a vLLM ``KVConnectorBase_V1``
  (``--kv-transfer-config '{"kv_connector": "TieredKVConnector", "kv_connector_module_path":
  "tiered_kv.integrations.vllm", ...}'``); the only module here that imports vllm.
- :mod:`tiered_kv.integrations.trtllm`: ``TieredKVScheduler`` / ``TieredKVWorker`` for
  TensorRT-LLM's ``KvCacheConnectorConfig``.
- :mod:`tiered_kv.integrations.common`: settings from extra-config dicts, one store per process.

Nothing is imported here, so ``import tiered_kv.integrations`` needs neither engine.
"""
