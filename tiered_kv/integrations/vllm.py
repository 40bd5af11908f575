"""vLLM adapter: ``TieredKVConnector``, a ``KVConnectorBase_V1`` over the connector core.

Attach by configuration only::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "TieredKVConnector",
        "kv_connector_module_path": "tiered_kv.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"disk": {"url": "lmdb:///var/cache/tiered-kv"}}}'

``kv_connector_extra_config`` takes the keys of our TOML file plus ``config_file``, ``load_async``,
``save`` and ``kv_layout`` (:mod:`tiered_kv.integrations.common`). vLLM builds one instance per
role, usually in different processes: the scheduler one looks blocks up in the worker's store
when a worker lives in its process, else in the lower tiers (:mod:`tiered_kv.store.lower_index`).

Semantics kept: keys come from token ids (vLLM's own block hashes are process-seeded), with
LoRA, ``cache_salt`` and multimodal hashes folded in; the KV layout is detected when the worker
registers its caches and an unknown one stops start-up with one ConfigError line; a finished
request with saves is held (``request_finished -> True``) and reported in ``finished_sending``
only after vLLM passed its id in ``finished_req_ids``; preempted requests forget their blocks and
are matched anew when resumed; failed blocks go to ``get_block_ids_with_load_errors``. With vLLM's
KV events on, the store's blocks stored and removed per tier are published with vLLM's own
(:mod:`tiered_kv.integrations.vllm_events`).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field, replace
from typing import Any

from tiered_kv.config import layerwise_on
from tiered_kv.connector.meta import ConnectorMeta
from tiered_kv.errors import ConfigError
from tiered_kv.integrations import vllm_events, vllm_lifecycle
from tiered_kv.integrations.common import (
    acquire_store,
    parse_settings,
    release_store,
)
from tiered_kv.integrations.vllm_groups import group_ids, is_replicated, request_level_failures
from tiered_kv.integrations.vllm_namespace import SOURCE, vllm_namespace
from tiered_kv.integrations.vllm_scheduler import SchedulerSide, group0, mm_content_hashed
from tiered_kv.keys import Namespace

log = logging.getLogger(__name__)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
        SupportsHMA,
    )
except ImportError:  # vllm not installed: duck-typed stand-ins, so the adapter can be unit-tested

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass

    class KVConnectorBase_V1:  # type: ignore[no-redef]
        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role
            self._connector_metadata = None

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

    class SupportsHMA:  # type: ignore[no-redef]
        pass

    @dataclass
    class KVConnectorTransferResults:  # type: ignore[no-redef]
        finished_sending: set = field(default_factory=set)
        finished_recving: set = field(default_factory=set)
        failed_recving: set = field(default_factory=set)

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _DISK: Any = CacheHitSource.DISK
except ImportError:
    _DISK = None


@dataclass
class TieredKVMetadata(KVConnectorMetadata):
    """One step's plan for the workers (picklable: keys, block ids and request ids only)."""

    meta: ConnectorMeta = field(default_factory=ConnectorMeta)
    async_loads: tuple[str, ...] = ()  # requests whose loads complete through get_finished
    preempted: tuple[str, ...] = ()  # requests whose blocks vLLM freed in this step


class TieredKVConnector(KVConnectorBase_V1, SupportsHMA):
    """tiered-kv as a vLLM KV connector (``kv_role`` ``kv_both``), with vLLM's hybrid allocator
    on (``SupportsHMA``): every KV cache group's blocks are stored and loaded."""

    _cache_hit_source = _DISK

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None)
        is_worker = getattr(role, "name", str(role)).endswith("WORKER")
        try:
            self.settings = parse_settings(extra, source=SOURCE)
            self.namespace = vllm_namespace(vllm_config, kv_cache_config, self.settings.config,
                                            tp_rank=_tp_rank(vllm_config) if is_worker else 0)
            policy = str(getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "recompute"))
            if policy != "recompute":
                log.warning("tiered-kv: kv_load_failure_policy=%s: a block that fails its checks aborts its "
                            "request; set kv_load_failure_policy='recompute' to recompute it instead", policy)
            self._request_failures = request_level_failures(
                self.namespace.groups, len(getattr(kv_cache_config, "kv_cache_groups", None) or ()))
            if self._request_failures and not self.settings.load_async:
                log.info("tiered-kv: KV groups %s: loads are asynchronous (a failed load fails the request)",
                         [g.kind for g in self.namespace.groups])
                self.settings = replace(self.settings, load_async=True)
        except ConfigError as exc:
            log.error("tiered-kv: %s", exc)  # the one line to read in the start-up log
            raise
        self._sched: SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        events = bool(getattr(getattr(vllm_config, "kv_events_config", None), "enable_kv_cache_events", False))
        if events:
            vllm_events.check_media(self.settings.config)
        if is_worker:
            # the namespace's groups are vLLM's, in vLLM's order
            layer_names = ([list(g.layer_names) for g in kv_cache_config.kv_cache_groups]
                           if self.namespace.groups else None)
            writer = not (self.namespace.groups and is_replicated(self.namespace.groups)) or _tp_rank(vllm_config) == 0
            self._worker = _WorkerSide(self.settings, self.namespace, layer_names, writer)
            self._worker.core.request_failures = self._request_failures
            if events:  # vLLM publishes KV events: this store's go with them (vllm_events)
                self._worker.feed = self._worker.store.events.subscribe()
                self._worker.rank = _tp_rank(vllm_config)
        else:
            ranks = 1 if self.namespace.groups and is_replicated(self.namespace.groups) else \
                int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
            tracker = vllm_events.VllmEventTracker(self.namespace.block_size, ranks) if events else None
            self._sched = SchedulerSide(self.settings, self.namespace, tracker,
                                        getattr(getattr(vllm_config, "device_config", None), "device_type", None),
                                        mm_keyed=mm_content_hashed(vllm_config))

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache, not a hand-off: a save lost to preemption is a future miss, nothing more."""
        return False

    # -- scheduler side ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        ids = blocks.get_block_ids() if hasattr(blocks, "get_block_ids") else blocks
        ids = group_ids(ids, len(self.namespace.groups)) if self.namespace.groups else group0(ids)
        self._sched.update_state_after_alloc(request, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> TieredKVMetadata:
        return TieredKVMetadata(*self._sched.build_connector_meta(scheduler_output))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self._sched.request_finished(request, block_ids), None

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """vLLM's hybrid allocator finishes a request once for all its KV cache groups."""
        return self._sched.request_finished(request, block_ids), None

    def update_connector_output(self, connector_output: Any) -> None:
        """Blocks that failed to load on any rank (vLLM aggregates ``invalid_block_ids`` over
        the workers): KV computed over them is withdrawn from every rank's store next step."""
        failed = getattr(connector_output, "invalid_block_ids", None)
        if failed and self._sched is not None and self._sched.core is not None:
            self._sched.core.blocks_failed(failed)
        if self._sched is not None and self._sched.events is not None:
            self._sched.events.receive(getattr(connector_output, "kv_cache_events", None))

    def reset_cache(self) -> bool:
        """vLLM resets its prefix cache (``reset_connector=True``; sleep, ``pause_generation``):
        the store is kept, by design (README: sleep mode); True, so vLLM's reset goes on."""
        log.info("tiered-kv: vLLM reset its prefix cache; the store keeps its blocks (namespace unchanged)")
        return True

    def take_events(self) -> list:
        """vLLM's ``BlockStored`` / ``BlockRemoved`` for the store's tiers since the last call."""
        events = self._sched.events if self._sched is not None else None
        return events.take() if events is not None else []

    # -- worker side ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict) -> None:
        try:
            self._worker.register(kv_caches)
        except ConfigError as exc:
            log.error("tiered-kv: %s: %s", SOURCE, exc)
            raise

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._worker.core.clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if getattr(kv_connector_metadata, "preempted", ()):
            self._worker.core.flush_copies()  # their blocks may be reused by this step

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        self._worker.core.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """vLLM's attention calls this before each layer: that layer's part of the step's sync
        loads is copied in (layer-wise loads; models with KV groups load whole in start_load_kv)."""
        self._worker.core.wait_for_layer_load(self._worker.layer_index.get(layer_name))

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise loads wait between layers: a CUDA graph replay would skip the waits."""
        try:
            return layerwise_on(parse_settings(extra_config, source=SOURCE).config.layerwise_loads, "cuda")
        except ConfigError:
            return False

    def save_kv_layer(self, layer_name: str, kv_layer: Any = None, attn_metadata: Any = None,
                      **kwargs: Any) -> None:
        """Blocks are gathered from every layer in wait_for_save."""

    def wait_for_save(self) -> None:
        self._worker.core.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Saves and loads done, and async loads that failed: those are also "received" (vLLM
        releases them from waiting) and recomputed from token 0."""
        self._worker.core.takes_failed_requests = True  # (before get_finished finishes loads)
        saved, loaded = self._worker.get_finished(finished_req_ids)
        failed = self._worker.core.take_failed_requests()
        return KVConnectorTransferResults(finished_sending=set(saved or ()),
                                          finished_recving=set(loaded or ()) | failed, failed_recving=failed)

    def get_kv_connector_kv_cache_events(self) -> Any:
        """This step's block events of the store, on their way to the scheduler half."""
        feed = self._worker.feed if self._worker is not None else None
        return vllm_events.worker_events(feed, self._worker.rank) if feed is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Failed block ids; none where loads fail as whole requests (several KV cache groups,
        which vLLM cannot map block ids back from; sliding windows and state, where resuming
        at a failed block would need blocks or state that were never loaded)."""
        errors = self._worker.core.get_block_ids_with_load_errors()
        return set() if self._request_failures else errors

    # -- sleep mode (vLLM 0.33; :mod:`tiered_kv.integrations.vllm_lifecycle`) --------------------
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        return vllm_lifecycle.supports_sleep_mode(kv_transfer_config)

    def unregister_kv_caches(self) -> None:
        vllm_lifecycle.unregister_kv_caches(self._worker.core if self._worker is not None else None)

    def restore_kv_caches(self) -> None:
        vllm_lifecycle.restore_kv_caches(self._worker.core if self._worker is not None else None)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._sched is not None:
            self._sched.close()


def _tp_rank(vllm_config: Any) -> int:
    """This worker's tensor-parallel rank. With one rank it is 0; with several it must be read
    from vLLM's TP group: guessing 0 would make every rank store and load rank 0's shard."""
    size = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception as exc:  # no TP group (stand-ins, or a single process without one)
        if size == 1:
            return 0
        raise ConfigError(f"{SOURCE}: tensor_parallel_size={size} but this worker's tensor-parallel "
                          f"rank cannot be read from vLLM ({type(exc).__name__}); refusing to guess "
                          "rank 0") from None


class _WorkerSide:
    def __init__(self, settings, namespace: Namespace, layer_names: list[list[str]] | None = None,
                 writer: bool = True) -> None:
        from tiered_kv.connector.worker import ConnectorWorker

        self.store = acquire_store(settings.config, namespace)
        self.core = ConnectorWorker(self.store, layout=settings.kv_layout, writer=writer)
        self.layer_names = layer_names  # per KV group (namespaces with groups)
        self.layer_index: dict[str, int] = {}  # layer name -> its layer in the store's blocks
        self.async_loads: tuple[str, ...] = ()
        self.loading: set[str] = set()  # requests whose async load is not reported received yet
        self.feed = None  # block events of the store, when vLLM publishes KV events
        self.rank = 0
        self.closed = False

    def register(self, kv_caches: dict) -> None:
        if self.layer_names is None:
            self.core.register_kv_caches(kv_caches)
            self.layer_index = {name: i for i, name in enumerate(kv_caches)}  # make_layout's order
            return
        missing = [n for names in self.layer_names for n in names if n not in kv_caches]
        if missing:
            raise ConfigError(f"vLLM registered no KV cache for layers {missing[:4]}")
        self.core.register_kv_caches([[kv_caches[n] for n in names] for names in self.layer_names])

    def bind(self, metadata: Any) -> None:
        meta = getattr(metadata, "meta", None)
        self.core.bind_connector_meta(meta if isinstance(meta, ConnectorMeta) else ConnectorMeta())
        self.async_loads = tuple(getattr(metadata, "async_loads", ()) or ())

    def get_finished(self, finished_req_ids) -> tuple[set[str] | None, set[str] | None]:
        """A request aborted while its async load is in flight is reported once, as received:
        vLLM holds its blocks until then and frees them at the first report (a finished_sending
        too freed them under the load, and the second report crashed vLLM's scheduler)."""
        saved, loaded = self.core.get_finished(finished_req_ids or (), self.async_loads)
        # an id whose load the core no longer waits on (none started here: dropped after two
        # start_load_kv calls, .started_loads) would stay for good and hide that id's saves
        waited = self.core.started_loading
        self.loading = {r for r in (self.loading | set(self.async_loads)) - set(loaded) if r in waited}
        self.async_loads = ()
        return set(saved) - self.loading - set(loaded) or None, set(loaded) or None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.feed is not None:
            self.store.events.unsubscribe(self.feed)
        self.core.close()
        release_store(self.store)
