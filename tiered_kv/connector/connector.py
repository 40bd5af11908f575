"""Both halves in one object, for engines that run them in one process (our reference engine)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tiered_kv.config import TieredKVConfig
from tiered_kv.connector.scheduler import ConnectorScheduler
from tiered_kv.connector.worker import ConnectorWorker
from tiered_kv.keys import Namespace
from tiered_kv.store import TieredStore
from tiered_kv.store.block_events import DEFAULT_LIMIT, EventFeed


class TieredKVConnector:
    """Scheduler half + worker half over one :class:`TieredStore`."""

    def __init__(self, store: TieredStore, *, load_async: bool = False, save: bool = True,
                 layout: str | None = None, writer: bool = True) -> None:
        self.store = store
        self.scheduler = ConnectorScheduler(store, store.namespace, load_async=load_async, save=save)
        self.worker = ConnectorWorker(store, layout=layout, writer=writer)

    # scheduler half
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids) -> bool:
        return self.scheduler.request_finished(request, block_ids)

    # worker half
    def register_kv_caches(self, kv_caches) -> None:
        self.worker.register_kv_caches(kv_caches)
        self.scheduler.restore.streams_layers(self.worker.streams_layers)  # ("auto": by the engine's device)

    def bind_connector_meta(self, meta) -> None:
        self.worker.bind_connector_meta(meta)

    def start_load_kv(self, *args, **kwargs) -> None:
        self.worker.start_load_kv()

    def wait_for_layer_load(self, layer_idx: int | None = None, *args, **kwargs) -> None:
        self.worker.wait_for_layer_load(layer_idx)

    def save_kv_layer(self, *args, **kwargs) -> None:
        self.worker.save_kv_layer()

    def wait_for_save(self, *args, **kwargs) -> None:
        self.worker.wait_for_save()
        # an engine that skipped layer waits gets whole loads from now on: predict those
        self.scheduler.restore.streams_layers(self.worker.streams_layers)

    def get_finished(self, finished_req_ids, started_loading_req_ids=()):
        return self.worker.get_finished(finished_req_ids, started_loading_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed = self.worker.get_block_ids_with_load_errors()
        self.scheduler.blocks_failed(failed)  # what an engine's scheduler learns from its workers
        return failed

    def subscribe_block_events(self, limit: int = DEFAULT_LIMIT) -> EventFeed:
        """A feed of the blocks each tier of the store stores and removes
        (:mod:`tiered_kv.store.block_events`)."""
        return self.store.events.subscribe(limit)

    def close(self) -> None:
        self.worker.close()
        self.store.close()


def build_connector(config: TieredKVConfig | Mapping[str, Any] | str | None, namespace: Namespace,
                    **options) -> TieredKVConnector:
    """A connector with its own store, from a config object, dict or TOML path."""
    if not isinstance(config, TieredKVConfig):
        config = TieredKVConfig.load(config)
    return TieredKVConnector(TieredStore(config, namespace), **options)
