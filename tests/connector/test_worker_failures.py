"""The worker half when the store closes under a step's layer-wise loads (an engine shutting
down while a forward runs): nothing the forward reads is unchecked, every block of those loads
is a load error the engine recomputes, no wait blocks, and no lease is left held."""

from __future__ import annotations

import torch

from tests.connector.test_layerwise_loads import NS, _config, _stored
from tiered_kv.connector.meta import ConnectorMeta, LoadSpec
from tiered_kv.connector.worker import ConnectorWorker
from tiered_kv.store import TieredStore


def test_a_store_closed_between_start_load_kv_and_the_layer_waits_fails_every_block_and_holds_no_lease(tmp_path):
    keys, _ = _stored(tmp_path)
    store = TieredStore(_config(tmp_path / "db"), NS)  # empty host tier: every block from disk
    worker = ConnectorWorker(store)
    kv = torch.zeros((2, NS.num_layers, 16, NS.block_size, NS.num_kv_heads, NS.head_dim), dtype=torch.bfloat16)
    worker.register_kv_caches(kv)
    assert worker.streams_layers
    worker.bind_connector_meta(ConnectorMeta(loads=[LoadSpec("r", tuple(keys), tuple(range(len(keys))), False)]))
    worker.start_load_kv()
    store.close()  # the slab's views are dropped: no layer may be copied out of it any more
    for layer in range(NS.num_layers):
        worker.wait_for_layer_load(layer)
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == set(range(len(keys)))
    assert store.host.stats().extra["leased"] == 0
    assert worker.get_finished([], []) == ([], [])
    worker.close()
