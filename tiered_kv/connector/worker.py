"""Worker half of the connector: moves KV between the engine's device blocks and host slots.

Loads: ``start_load_kv`` starts every load of the step in the store's pool (leased blocks are
decoded into host slots there); sync loads are scattered into the device blocks layer group by
layer group as ``wait_for_layer_load`` asks for them (:mod:`.layer_loads`; whole before the
forward where the engine or model cannot), async ones when ``get_finished`` finds them complete. Saves: ``wait_for_save`` gathers
the step's completed blocks into reserved host slots in one batched copy and commits them (on
CUDA: a copy on a side stream, committed once its event completed, so the forward never waits);
write-behind to the lower tiers runs in the pool.

Nothing computed over a block that failed to load is saved. Engines share a block loaded for
one request with other requests of the same step (vLLM's prefix cache), so failures are tracked
by *block id*: a failed block is tainted until a later step computes it again (it then appears
among a save's own blocks), and a save whose request's block table holds a tainted block before
its own blocks is dropped (counted ``saves_dropped_failed_load``). Keys the scheduler names in
``invalidate`` (computed over a block that failed on some rank) are withdrawn from every tier
before the step's loads and saves (:mod:`tiered_kv.store.invalidation`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from tiered_kv.config import layerwise_on
from tiered_kv.connector.cost_observer import CostObserver
from tiered_kv.connector.device_copies import scatter, settle_side_stream
from tiered_kv.connector.dropped_loads import DroppedLoads
from tiered_kv.connector.group_layout import GroupLayout
from tiered_kv.connector.layer_loads import LayerLoads
from tiered_kv.connector.layout import KVLayout, device_ids, make_layout
from tiered_kv.connector.load_starts import failed_plan, start_load
from tiered_kv.connector.meta import ConnectorMeta, LoadSpec, SaveSpec, save_groups
from tiered_kv.connector.save_copies import SaveCopies
from tiered_kv.connector.started_loads import StartedLoads
from tiered_kv.store import LoadPlan, SaveBatch, TieredStore

log = logging.getLogger(__name__)

LOAD_STATS_KEPT = 4096


@dataclass
class _PendingLoad:
    spec: LoadSpec
    plan: LoadPlan
    failed: list[int] = field(default_factory=list)


class ConnectorWorker:
    """Engine-neutral worker half over a :class:`TieredStore`."""

    def __init__(self, store: TieredStore, layout: str | None = None, *, writer: bool = True,
                 layerwise: bool | None = None) -> None:
        self.store = store
        # sync loads arrive layer group by layer group (wait_for_layer_load); None: as configured
        # ("auto" is settled by the engine's device in register_kv_caches)
        self._layerwise_setting = store.config.layerwise_loads if layerwise is None else layerwise
        self.layerwise = layerwise_on(self._layerwise_setting, None)
        self._layer_loads: LayerLoads | None = None  # this step's sync loads, copied in layer by layer
        self.costs = CostObserver(store)  # teaches the store's restore and prefill estimates
        self.declared_layout = layout
        self.writer = writer  # False: another rank stores the same bytes (MLA); saves are only reported
        self.layout: KVLayout | GroupLayout | None = None
        self.meta, self._unsaved = ConnectorMeta(), False  # (_unsaved: saves bound, wait_for_save not run)
        self._async_loads: dict[str, _PendingLoad] = {}
        self._dropped = DroppedLoads(store)  # replaced async loads, released once their reads ended
        self._saves = SaveCopies(store)  # device->host copies not committed yet
        self._save_requests: set[str] = set()  # requests that had saves and are not reported
        self._finished: set[str] = set()  # finished ids passed in, not yet reported
        self.started_loading = StartedLoads()  # ids passed as started, aged by start_load_kv calls
        self._load_errors: set[int] = set()  # failed block ids not yet reported to the engine
        self._tainted: set[int] = set()  # failed block ids no step has computed again since
        self._failed_requests: set[str] = set()  # async loads that failed, kept for an engine that
        self.takes_failed_requests = False  # takes them (set by its adapter: vLLM's transfer results)
        # the engine fails a failed load's whole request and recomputes it from token 0 (set by the
        # adapter): no block is tainted then (its id is freed and reused, never recomputed in place)
        self.request_failures = False
        self._reused_next_step = any(g.kind in ("sliding", "chunked", "state") for g in store.namespace.groups)
        self._stream = None
        self._load_stream = None
        # request -> blocks per serving tier, for reports; the oldest entries are dropped
        self.load_stats: OrderedDict[str, dict[str, int]] = OrderedDict()

    # -- set-up ----------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        ns = self.store.namespace
        if ns.groups:
            self.layout = GroupLayout(ns, kv_caches, self.declared_layout)
        else:
            self.layout = make_layout(ns, kv_caches, self.declared_layout)
        self.layerwise = layerwise_on(self._layerwise_setting, self.layout.device.type)
        if self.layout.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.layout.device)  # saves
            self._load_stream = torch.cuda.Stream(device=self.layout.device)
        log.info("connector worker: %s layout on %s, %s loads", self.layout.name, self.layout.device,
                 "layer-wise" if self.streams_layers else "whole-block")

    @property
    def streams_layers(self) -> bool:
        """Whether this step's sync loads arrive layer group by layer group: asked for, and blocks
        that are one stack of layers (not KV groups' entries)."""
        return self.layerwise and isinstance(self.layout, KVLayout) and self.store.namespace.num_layers > 1

    def bind_connector_meta(self, meta: ConnectorMeta) -> None:
        self.meta, self._unsaved = meta, bool(meta.saves)  # (until wait_for_save ran: .get_finished)
        self._save_requests.difference_update(meta.forget)  # (paused: answered False, never reported)

    def clear_connector_metadata(self) -> None:
        self.meta, self._unsaved = ConnectorMeta(), False

    # -- loads -----------------------------------------------------------------------------------
    def start_load_kv(self, *args, **kwargs) -> None:
        self._finish_layer_loads()  # (the engine skipped wait_for_save: never left running)
        self._saves.commit_ready({k for s in self.meta.loads for k in (*s.keys, s.state_key) if k})  # .save_copies
        if self.meta.invalidate:
            self.flush_copies()  # a save of those keys still copying must not be committed later
            self.store.invalidate(self.meta.invalidate)
        start = time.perf_counter()
        layered = self.streams_layers
        sync: list[_PendingLoad] = []
        for spec in self.meta.loads:
            pending = _PendingLoad(spec, start_load(self.store, spec, layered and not spec.is_async))
            if spec.is_async:
                self._add_async_load(pending)
            elif pending.plan.released:  # the store was closed: every block failed (.load_starts)
                self._finish_load(pending)
            else:
                sync.append(pending)
        self.started_loading.loads_started(self._async_loads)  # (after this step's loads: .started_loads)
        self.costs.step_started(bool(self.meta.loads))
        if layered and sync:  # copied layer by layer as the forward asks for them
            self._layer_loads = LayerLoads(sync, self.layout, self.store.slots,
                                           self.store.namespace.num_layers, self._load_stream)
            return
        for pending in sync:
            try:
                pending.plan.wait()
            except Exception:  # a load job that failed as a whole: all its blocks are errors
                log.exception("request %s: load job failed", pending.spec.request_id)
            self._finish_load(pending)
        if sync:
            self.costs.restored([p.plan for p in sync], time.perf_counter() - start)

    def _add_async_load(self, pending: _PendingLoad) -> None:
        """Keep ``pending`` until ``get_finished`` reports it. An earlier async load under its id
        not reported yet is dropped: its blocks never written, its lease released once its reads
        ended (:mod:`.dropped_loads`: never waited for here, on the engine's thread). Defensive:
        vLLM makes ids unique (a random suffix) and refuses a duplicate of a request held for its
        load report; an engine that reuses an id has aborted that request, and waits for one
        report of the id, for the blocks of the new load."""
        old = self._async_loads.pop(pending.spec.request_id, None)
        if old is not None:
            self._dropped.add(old.plan)
            self.store.metrics.event("async_loads_replaced")
            log.warning("request %s: a second async load before the first was reported; the first is "
                        "dropped", pending.spec.request_id)
        self._async_loads[pending.spec.request_id] = pending

    def wait_for_layer_load(self, layer: int | None = None, *args, **kwargs) -> None:
        """Before layer ``layer`` (index among the layers that page KV) reads KV: copy its part in."""
        if self._layer_loads is not None and isinstance(layer, int):
            self._layer_loads.wait(layer)

    def _finish_layer_loads(self) -> None:
        """End the step's layer-wise loads and report what failed (:meth:`LayerLoads.finish`)."""
        loads, self._layer_loads = self._layer_loads, None
        if loads is None:
            return
        if not loads.finish():
            self.layerwise = False  # this engine does not wait for every layer: whole loads from now on
        for pending in loads.pendings:
            self._finish_load(pending, layered=loads)
        self.costs.restored([p.plan for p in loads.pendings], loads.seconds)

    def _finish_load(self, pending: _PendingLoad, layered: LayerLoads | None = None) -> None:
        """Scatter what loaded; a block that did not is an error the engine recomputes. With
        recurrent state, anything missing fails the whole load: resuming at an earlier block
        would need the state there, so the engine recomputes from the first token."""
        plan, spec = pending.plan, pending.spec
        n = len(spec.keys)
        slots, rows = plan.slots[:n], spec.block_rows()
        good = [(b, s) for b, s in zip(rows, slots) if s is not None]
        bad = [b for b, s in zip(spec.block_ids, slots) if s is None]
        state_slot = plan.slots[n] if spec.state_key else None
        if (spec.state_key and (bad or state_slot is None)) or (layered is not None and not layered.complete):
            good, bad = [], list(spec.block_ids)  # (layer-wise: layers the forward read before they came)
        try:
            if good and layered is None:
                self._scatter([b for b, _ in good], [s for _, s in good])
            if state_slot is not None and not bad:  # (a hit may keep no token block: a chunk edge)
                self._scatter([spec.state_ids], [state_slot], state=True)
        except Exception:  # a copy that failed leaves nothing trustworthy in those blocks
            log.exception("request %s: scattering loaded blocks failed", spec.request_id)
            bad = list(spec.block_ids)
        finally:
            self.store.release(plan)
        stats = self.load_stats.setdefault(spec.request_id, {})
        while len(self.load_stats) > LOAD_STATS_KEPT:
            self.load_stats.popitem(last=False)
        for tier in plan.served:
            stats[tier or "failed"] = stats.get(tier or "failed", 0) + 1
        # loaded and checked: trustworthy again
        self._tainted.difference_update({b for b, s in zip(spec.block_ids, slots) if s is not None} - set(bad))
        if bad and (spec.is_async or self.request_failures) and self.takes_failed_requests:
            self._failed_requests.add(spec.request_id)
        if bad and self.request_failures:
            log.info("request %s: %d of %d blocks failed to load; the request is recomputed",
                     spec.request_id, len(bad), len(spec.block_ids))
        elif bad:
            self._load_errors.update(b for b in bad if b >= 0)
            self._tainted.update(bad)
            log.info("request %s: %d of %d blocks failed to load and will be recomputed",
                     spec.request_id, len(bad), len(spec.block_ids))

    def _scatter(self, block_ids: list, slots: list[int], state: bool = False) -> None:
        scatter(self.layout, self.store.slots, self._load_stream, block_ids, slots, state)  # (.device_copies)

    def take_failed_requests(self) -> set[str]:
        """Requests whose async load failed since the last call (engines that cannot map block
        ids back to requests, such as vLLM with several KV cache groups, recompute them whole);
        kept only once ``takes_failed_requests`` is set (an engine that never takes them, such
        as TensorRT-LLM or ours, gets its failed blocks as load errors alone)."""
        failed, self._failed_requests = self._failed_requests, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_layer_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves -----------------------------------------------------------------------------------
    def save_kv_layer(self, *args, **kwargs) -> None:
        """Blocks are gathered for all layers at once in wait_for_save (one batched copy)."""

    def wait_for_save(self, *args, **kwargs) -> None:
        self._unsaved = False
        self._finish_layer_loads()
        self.costs.step_ended(self.meta, busy=bool(self._async_loads))
        specs = [s for s in self.meta.saves if s.keys or s.state_key]
        if not specs:
            return
        for (tenant, state), (items, owners) in self._save_items(specs).items():
            if not self.writer:  # the writer rank stores these bytes; report them saved
                continue
            batch = self.store.prepare_save([k for k, _ in items], tenant)
            if batch.keys:
                index = dict(items)
                try:
                    self._gather([index[k] for k in batch.keys], batch.slots, batch, owners, state)
                except Exception:  # (caches unregistered, a device error): a lost save, never a crash
                    log.exception("saving %d blocks failed; they are not stored", len(batch.keys))
                    settle_side_stream(self._stream)  # (copies it queued write the slots until then)
                    self.store.commit_save(batch, ok=False)
                    self.store.metrics.event("saves_failed", len(batch.keys))
        self._saves.commit_ready()

    def _save_items(self, specs: list[SaveSpec]) -> dict[tuple, tuple[list[tuple[bytes, object]], set[str]]]:
        """Per (tenant, state entries or not): (key, block id or row) of the saves to make, and
        the requests they belong to."""
        kept, dropped = [], []
        for spec in specs:
            self._save_requests.add(spec.request_id)
            over_failed = self._tainted and not self._tainted.isdisjoint(spec.context_block_ids)
            (dropped if over_failed else kept).append(spec)
        for spec in kept:  # computed in this step over a clean prefix: trustworthy again
            self._tainted.difference_update(spec.block_ids)
        for spec in dropped:  # computed over garbage: as untrustworthy as the failed block
            self._tainted.update(spec.block_ids)
        if dropped:
            n = sum(len(spec.keys) for spec in dropped)
            self.store.metrics.event("saves_dropped_failed_load", n)
            log.info("%d blocks of %d requests were computed over a failed load and are not saved",
                     n, len({spec.request_id for spec in dropped}))
        return save_groups(kept)

    def _gather(self, block_ids: list, slots: list[int], batch: SaveBatch, owners: set[str],
                state: bool = False) -> None:
        assert self.layout is not None, "register_kv_caches was not called"
        gather = self.layout.gather_state if state else self.layout.gather
        if self._stream is None:
            ids = torch.tensor(block_ids, device=self.layout.device)
            data = gather(ids).view(len(block_ids), -1).view(torch.uint8)
            self.store.slots.fill(slots, data)
            self._saves.add(batch, owners)
            return
        # Stream rule: every CUDA tensor the side stream reads or writes is allocated on it (the
        # caching allocator may hand a block freed on another stream to someone else while the
        # side stream still uses it); the engine's pool is ordered by wait_stream, host slots
        # stay reserved until the event completed. The engine's next work waits for the gather (a
        # device copy: a block freed meanwhile, by a preemption or a TensorRT-LLM pause, may be
        # written by it), not for the host copy after it.
        engine = torch.cuda.current_stream(self.layout.device)
        self._stream.wait_stream(engine)
        with torch.cuda.stream(self._stream):
            ids = device_ids(block_ids, self.layout.device)
            data = gather(ids).view(len(block_ids), -1).view(torch.uint8)
            engine.wait_stream(self._stream)  # (up to the gather: the host copy is queued after)
            self.store.slots.fill(slots, data, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        if self._reused_next_step:  # sliding-window blocks and running state change next step
            engine.wait_event(event)
        self._saves.add(batch, owners, event)

    # -- completion ------------------------------------------------------------------------------
    def get_finished(self, finished_req_ids, started_loading_req_ids=()) -> tuple[list[str], list[str]]:
        """(saved ids, loaded ids); each id only after the engine passed it in. A plan's saves in
        a step that ran no forward (vLLM skips wait_for_save there) are made here: the blocks hold
        what earlier steps computed, and a request held for them would never be reported."""
        if self._unsaved and self.meta.step_tokens == 0:
            self.wait_for_save()
        self._saves.commit_ready()
        self._dropped.sweep()
        self._finished.update(finished_req_ids or ())
        self.started_loading.arrived(started_loading_req_ids or ())
        busy = self._saves.busy_requests()
        saved = sorted(r for r in self._finished if r in self._save_requests and r not in busy)
        for r in saved:
            self._finished.discard(r)
            self._save_requests.discard(r)
        self._finished -= {r for r in self._finished if r not in self._save_requests}
        loaded = self.started_loading.ready(self._async_loads)
        for rid in loaded:
            self._finish_load(self._async_loads.pop(rid))
        self.started_loading.reported(loaded)
        return saved, loaded

    def flush_copies(self) -> None:
        """Wait for in-flight device->host copies and commit them: the engine is about to reuse
        blocks it did not hold for us (vLLM frees a preempted request's blocks at once)."""
        if self._stream is not None:
            self._stream.synchronize()
        self._saves.commit_ready()

    def close(self) -> None:
        """Release what is held; an async load in flight is reported by the next ``get_finished``
        with every block failed (dropped, its request waited for good: the engine recomputes)."""
        self._finish_layer_loads()
        for rid, pending in self._async_loads.items():
            self.store.release(pending.plan)
            self._async_loads[rid] = _PendingLoad(pending.spec, failed_plan(pending.plan.keys))
        self._dropped.release_all()
        self.flush_copies()
