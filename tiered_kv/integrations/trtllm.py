"""TensorRT-LLM adapter: ``TieredKVScheduler`` / ``TieredKVWorker`` for ``KvCacheConnectorConfig``.

Attach by configuration only::

    LLM(model, backend="pytorch", kv_connector_config=KvCacheConnectorConfig(
        connector_module="tiered_kv.integrations.trtllm",
        connector_scheduler_class="TieredKVScheduler",
        connector_worker_class="TieredKVWorker"))

with the store configured by ``TIERED_KV_*`` variables (``TIERED_KV_CONFIG_FILE`` for a TOML
file, ``TIERED_KV_DISK_URL``, … see :mod:`tiered_kv.integrations.common`): TensorRT-LLM's
connector config carries no settings of its own. The namespace comes from ``llm_args`` (block
size) and the model's ``config.json`` (layers, KV heads, head size, dtype).

TensorRT-LLM has no way to report a failed load back to the engine. So the scheduler half
(rank 0, the same process as rank 0's worker) promises only blocks it has already validated:
``get_num_new_matched_tokens`` reads the matched blocks into leased host slots (a disk or Redis
block that is corrupt, foreign or gone is a counted miss that shortens the match) and the worker
then copies host slots into the pool, which cannot fail. For the same reason only one rank (no
tensor, pipeline or context parallelism) is supported. That read is the lower tier's restore the
restore policy weighs (it adds up with the prefill); what of a request changes its keys is read
by :mod:`tiered_kv.integrations.trtllm_requests` (salt, LoRA, multimodal hashes). A request its
keys cannot name (media without hashes, a prompt-tuning table, ...) is neither loaded nor saved,
counted as ``requests_not_keyed``; one searching several beams has only its prompt saved.

The executor's order per step: schedule -> ``get_num_new_matched_tokens`` / allocation /
``update_state_after_alloc`` -> ``build_connector_meta`` -> ``start_load_kv`` -> forward (per layer
``wait_for_layer_load`` / ``save_kv_layer``) -> ``wait_for_save`` -> sample -> ``request_finished`` -> ``get_finished``.

Layer groups: TensorRT-LLM keeps one KV layer group per attention window size and, with
``KVCacheManagerV2``, registers a ``KvCacheLayout`` (``register_kv_cache_layout``) and may pass
block ids per group (``update_state_after_alloc_by_layer_group``,
``request_finished_by_layer_group``: entry ``[g][i]`` is block ``i``'s page in group ``g``). One
full-attention group is followed (its list is the flat call's; its single pool the tensor
``register_kv_caches`` takes). Several groups or a window are refused: at construction when
``llm_args`` or config.json show a window (:mod:`tiered_kv.integrations.trtllm_model`), else when a
windowed layout is registered, a call carries several groups, or a block has no page (``-1``). A
pool with draft layers (one-model speculative decoding) is refused at registration.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from contextlib import nullcontext
from typing import Any

from tiered_kv.connector.meta import ConnectorMeta
from tiered_kv.connector.restore_policy import RestorePolicy
from tiered_kv.connector.scheduler import ConnectorScheduler
from tiered_kv.errors import ConfigError, StoreClosed
from tiered_kv.integrations.common import (
    acquire_store,
    parse_settings,
    release_store,
    released_on_error,
)
from tiered_kv.integrations.trtllm_model import SOURCE, WINDOWED, one_group, pages, trtllm_namespace
from tiered_kv.integrations.trtllm_model import target_pool as _target
from tiered_kv.integrations.trtllm_requests import beams, unkeyed
from tiered_kv.integrations.trtllm_requests import request_view as _view
from tiered_kv.integrations.trtllm_steps import core_steps
from tiered_kv.keys import tenant_label
from tiered_kv.store.futures import gather

log = logging.getLogger(__name__)

__all__ = ["TieredKVScheduler", "TieredKVWorker", "trtllm_namespace"]

try:  # the documented interface; its module moved between releases
    from tensorrt_llm._torch.pyexecutor.kv_cache_connector import (  # type: ignore
        KvCacheConnectorScheduler as _SchedulerBase,
    )
    from tensorrt_llm._torch.pyexecutor.kv_cache_connector import (  # type: ignore
        KvCacheConnectorWorker as _WorkerBase,
    )
except ImportError:
    try:
        from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import (  # type: ignore
            KvCacheConnectorScheduler as _SchedulerBase,
        )
        from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import (  # type: ignore
            KvCacheConnectorWorker as _WorkerBase,
        )
    except ImportError:  # not installed: duck-typed bases with the same constructor and helpers

        class _SchedulerBase:  # type: ignore[no-redef]
            def __init__(self, llm_args: Any) -> None:
                self._llm_args = llm_args

        class _WorkerBase:  # type: ignore[no-redef]
            def __init__(self, llm_args: Any) -> None:
                self._llm_args = llm_args
                self._metadata = None

            def bind_connector_meta(self, metadata: object) -> None:
                self._metadata = metadata

            def get_connector_meta(self) -> object:
                return self._metadata

            def _clear_connector_meta(self) -> None:
                self._metadata = None


class TieredKVScheduler(_SchedulerBase):
    """Scheduler half (rank 0): what to load and what to save."""

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self.settings = parse_settings(None, source=SOURCE)
        self.namespace = trtllm_namespace(llm_args, self.settings.config)
        self.store = acquire_store(self.settings.config, self.namespace)
        with released_on_error(self.store):  # (a lower tier's blocks are read here, before the step:
            # only host slots reach the forward; the restore policy adds a lower tier's read to the prefill)
            restore = RestorePolicy.for_index(self.store, self.namespace, load_async=self.settings.load_async,
                                              device="cuda", lower_streams=False)  # (TensorRT-LLM runs on GPUs)
            self.core = ConnectorScheduler(self.store, self.namespace, load_async=self.settings.load_async,
                                           save=self.settings.save, restore=restore)
        self._verified: dict[Any, tuple[int, int, Any]] = {}  # request -> (device, external, plan)
        # request -> (device prefix, tokens) at its allocation, until listed (.trtllm_steps)
        self._device_prefix: dict[Any, tuple[int, list[int]]] = {}
        self._unkeyed: set = set()  # live requests the keys cannot name (never loaded or saved)
        self._beamed: dict = {}  # live requests with several beams -> prompt length (only it is saved)
        log.info("tiered-kv TensorRT-LLM scheduler: %s, block %d tokens, %s loads",
                 self.namespace.model_id, self.namespace.block_size,
                 "async" if self.settings.load_async else "sync")

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        self._drop_verified(request.request_id)
        view = self._view(request)
        if view is None:
            return 0, False
        n, _ = self.core.get_num_new_matched_tokens(view, num_computed_tokens)
        if n <= 0:
            self._verified[view.request_id] = (num_computed_tokens, 0, None)
            return 0, False
        bs = self.namespace.block_size
        first = num_computed_tokens // bs
        keys = self.core.keys_of(view.request_id)[first : first + n // bs]
        tenant = tenant_label(view.tenant) if view.tenant else None  # checked here, counted at the lease
        start = time.perf_counter()
        plan = self.store.prepare_load(keys, tenant, count=False)
        try:
            self.store.load(plan)
        except StoreClosed:  # (closing at exit, after the lookup): nothing is promised
            self.store.release(plan)
            self._verified[view.request_id] = (num_computed_tokens, 0, None)
            return 0, False
        finished = True
        try:
            futures_wait(plan.futures, self.store.config.remote.timeout)  # one deadline for all
            plan.wait(0)
            self._observe(plan, time.perf_counter() - start)
        except FutureTimeout:  # a hung tier: promise only what needed no read (host-resident)
            finished = False
            log.warning("tiered-kv: reading matched blocks of %s took over %.1fs; promising the "
                        "host-resident ones", view.request_id, self.store.config.remote.timeout)
        except Exception:  # a failed read job: nothing of it is promised
            log.exception("tiered-kv: reading matched blocks of %s failed", view.request_id)
        good = 0
        while (good < len(keys) and good < len(plan.slots) and plan.slots[good] is not None
               and (finished or plan.sources[good] == "host")):
            good += 1
        if good < len(keys):
            log.info("request %s: %d of %d matched blocks failed validation; promising %d",
                     view.request_id, len(keys) - good, len(keys), good)
        self._verified[view.request_id] = (num_computed_tokens, good * bs, plan)
        return good * bs, bool(good) and self.settings.load_async

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int]) -> None:
        pages(block_ids, request.request_id, "update_state_after_alloc")
        view = self._view(request)
        if view is None:
            return
        if beams(request) > 1:
            self._beamed[view.request_id] = view.num_prompt_tokens
        device, external, plan = self._verified.pop(view.request_id, (0, 0, None))
        self._device_prefix[view.request_id] = (device, list(request.get_tokens(0)))
        # the core leases the promised blocks (now host-resident) before our read plan lets go
        self.core.update_state_after_alloc(view, list(block_ids), external)
        if plan is not None:
            self._release(plan)

    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMeta:
        """A request listed first after an allocation is new, in whichever list (:mod:`.trtllm_steps`)."""
        return self.core.build_connector_meta(core_steps(scheduler_output, self._device_prefix, self._unkeyed,
                                                         self._beamed))

    def request_finished(self, request: Any, cache_block_ids: Sequence[int]) -> bool:
        """True holds a finished request's blocks until saved. A paused one (``_pause_requests``, not
        finished) never is: TensorRT-LLM would park it in ``DISAGG_CONTEXT_TRANS_IN_PROGRESS`` for
        good; its blocks go back now (the engine's next work waits for the worker's gathers of them)."""
        self._drop_verified(request.request_id)
        self._device_prefix.pop(request.request_id, None)
        self._unkeyed.discard(request.request_id)
        self._beamed.pop(request.request_id, None)
        pages(cache_block_ids, request.request_id, "request_finished")
        if getattr(request, "is_finished", True) is False:
            self.core.request_paused(request.request_id)  # (a new request if scheduled again)
            return False
        return self.core.request_finished(request, list(cache_block_ids))

    # -- per-layer-group forms: entry [g][i] is block i's page in layer group g -----------------
    def update_state_after_alloc_by_layer_group(self, request: Any, block_ids_by_layer_group: Sequence) -> None:
        """One layer group is the flat call; several (a window per group) are refused."""
        self.update_state_after_alloc(request, one_group(block_ids_by_layer_group, request.request_id,
                                                         "update_state_after_alloc_by_layer_group"))

    def request_finished_by_layer_group(self, request: Any, cache_block_ids_by_layer_group: Sequence) -> bool:
        return self.request_finished(request, one_group(cache_block_ids_by_layer_group, request.request_id,
                                                        "request_finished_by_layer_group"))

    def _view(self, request: Any):
        """The core's view of ``request``; None for one its keys cannot name (counted once)."""
        view = _view(request)
        if view is None and request.request_id not in self._unkeyed:
            self._unkeyed.add(request.request_id)
            self.store.metrics.event("requests_not_keyed")
            log.info("request %s: %s; nothing of it is loaded or saved", request.request_id, unkeyed(request))
        return view

    def _observe(self, plan: Any, seconds: float) -> None:
        """A read of the matched blocks from one lower tier is that tier's restore (the worker's
        loads are host slots): the restore policy's estimate of the tier learns from it."""
        tiers = set(plan.served)
        costs = getattr(self.store, "costs", None)
        if costs is not None and plan.futures and len(tiers) == 1 and not tiers & {None, "host"}:
            costs.observe_restore(tiers.pop(), len(plan.keys) * self.store.block_nbytes, seconds)

    def _drop_verified(self, request_id: Any) -> None:
        entry = self._verified.pop(request_id, None)
        if entry is not None and entry[2] is not None:
            self._release(entry[2])

    def _release(self, plan: Any) -> None:
        """Release a read plan now, or when its reads end (never wait on a hung tier here)."""
        reads = gather(list(plan.futures))
        if reads is None or reads.done():
            self.store.release(plan)
        else:
            reads.add_done_callback(lambda _f: self.store.release(plan))

    def close(self) -> None:
        for request_id in list(self._verified):
            self._drop_verified(request_id)
        release_store(self.store)


class TieredKVWorker(_WorkerBase):
    """Worker half: copies blocks between TensorRT-LLM's pool and the store."""

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        from tiered_kv.connector.worker import ConnectorWorker

        self.settings = parse_settings(None, source=SOURCE)
        self.namespace = trtllm_namespace(llm_args, self.settings.config)
        self.store = acquire_store(self.settings.config, self.namespace)
        # whole loads, never layer-wise: a layer-wise load the forward does not wait on for every
        # layer (hooks skipped: a captured graph, a compiled forward) fails all its blocks, and
        # TensorRT-LLM, which cannot be told, computed over them; the promised blocks are host
        # slots already (read in the scheduler), so streaming them per layer hides no read
        with released_on_error(self.store):
            self.core = ConnectorWorker(self.store, layout=self.settings.kv_layout, layerwise=False)
        self._saving: set = set()  # requests whose saves ran in wait_for_save, not reported yet

    def register_kv_caches(self, kv_cache_tensor) -> None:
        """One pool tensor, block id on dim 0: ``[blocks, layers, 2, block elements]``."""
        self.core.register_kv_caches(_target(self._llm_args, kv_cache_tensor, self.namespace))

    def register_kv_cache_layout(self, layout) -> None:
        """``KVCacheManagerV2`` describes its pools (``KvCacheLayout``) instead of handing over one
        tensor: one full-attention layer group whose pages form one pool is registered as that
        pool; several groups, a window or pages in several regions are refused."""
        groups = list(layout.groups)
        windows = [getattr(g, "window_size", None) for g in groups]
        if len(groups) != 1 or windows[0] is not None:
            raise ConfigError(f"{SOURCE}: the KV cache has {len(groups)} layer group(s) with attention "
                              f"windows {windows}: {WINDOWED}")
        pool = layout.as_single_pool_tensor()
        if pool is None:
            raise ConfigError(f"{SOURCE}: the KV cache's pages are not one pool [blocks, layers, 2, "
                              "block] (block scales, or layers of differing size): unsupported KV layout")
        self.core.register_kv_caches(_target(self._llm_args, pool, self.namespace))

    def bind_connector_meta(self, metadata: object) -> None:
        super().bind_connector_meta(metadata)
        self._saving.difference_update(getattr(metadata, "forget", ()))
        self.core.bind_connector_meta(metadata if isinstance(metadata, ConnectorMeta) else ConnectorMeta())

    def start_load_kv(self, stream=None) -> None:
        with _on(stream):
            self.core.start_load_kv()

    def wait_for_layer_load(self, layer_idx: int, stream=None) -> None:
        """Before layer ``layer_idx``: its part of the step's loads is copied in (layer-wise)."""
        with _on(stream):
            self.core.wait_for_layer_load(layer_idx)

    def save_kv_layer(self, layer_idx: int, stream=None) -> None:
        """Blocks are gathered for all layers in wait_for_save."""

    def wait_for_save(self, stream=None) -> None:
        self._saving.update(s.request_id for s in self.core.meta.saves if s.keys or s.state_key)
        with _on(stream):
            self.core.wait_for_save()

    def get_finished(self, finished_gen_req_ids: list, started_loading_req_ids: list) -> tuple[list, list]:
        """(saved ids, loaded ids). An id held for saves that never ran has nothing to wait for
        and is reported at once: TensorRT-LLM skips ``wait_for_save`` when the step's forward
        raises and then ends every request (held ones too); unreported, it would hold their
        blocks for ever."""
        unsaved = [r for r in finished_gen_req_ids or () if r not in self._saving]
        saved, loaded = self.core.get_finished(finished_gen_req_ids, started_loading_req_ids)
        if unsaved:
            log.warning("tiered-kv: requests %s ended before their planned saves ran (a failed "
                        "step?): nothing of them is stored; their blocks are released", unsaved)
        saved = [*saved, *unsaved]
        self._saving.difference_update(saved)
        errors = self.core.get_block_ids_with_load_errors()
        if errors:  # promised blocks were validated host slots: this is a bug, and it is loud
            log.error("tiered-kv: %d promised blocks failed to load: %s", len(errors), sorted(errors))
        return list(saved), list(loaded)

    def subscribe_block_events(self, limit: int = 1 << 16) -> Any:
        """A feed of the blocks each tier of the store stores and removes, for a router or a
        publisher of the deployment's own (:mod:`tiered_kv.store.block_events`)."""
        return self.store.events.subscribe(limit)

    def close(self) -> None:
        self.core.close()
        release_store(self.store)


def _on(stream):
    """Run on the engine's CUDA stream when one is given (a no-op on CPU)."""
    if stream is not None and type(stream).__module__.startswith("torch.cuda"):
        import torch

        return torch.cuda.stream(stream)
    return nullcontext()
