"""TieredStore: the host tier plus an ordered list of lower tiers, with async transfers.

Lifecycle of a block:

- **save**: ``prepare_save(keys)`` reserves host slots (phase one, invisible), the caller fills
  them (``slot_tensor``), ``commit_save`` makes them visible (phase two) or rolls them back, and
  queues write-behind to the lower tiers whose policy is ``write_through`` and whose admission
  lets the block in (``on_evict`` tiers get a block when the host tier evicts it). Saves over
  the in-flight budget are dropped from write-behind and counted (the host copy stays).
- **lookup(keys)**: the number of leading keys present in some tier; no side effects.
- **load**: ``prepare_load(keys)`` leases the blocks (host pins, lower-tier pins), ``load(plan)``
  runs in the pool: host hits are ready at once, lower-tier hits are validated and decoded into
  freshly reserved host slots (promotion) and leased to the caller; ``release(plan)`` ends the
  lease. Failures are per block with a counted reason; nothing unvalidated is handed out.
  ``load_into(keys, outs)`` (the synchronous form) decodes lower-tier blocks straight into
  ``outs`` when they are plain CPU blocks: host memory already, so no host slot is taken.

**Block events**: ``events`` (:class:`~tiered_kv.store.block_events.BlockEvents`) tells its
subscribers which tier stored or removed which blocks (``store.events.subscribe()``).

**Restore costs**: ``costs`` (:class:`~tiered_kv.store.restore_costs.RestoreCosts`) learns what
restores from each tier and the engine's prefill steps take (the connector's worker observes,
its scheduler's restore policy reads); it starts from the estimates in the namespace record of
the first lower tier holding some (never an ``off`` one: this process does not write those),
and is written back at most every ``COSTS_SAVE_S`` seconds and at flush / close
(:class:`~tiered_kv.store.cost_records.CostsKeeper`). Blocks the policy left unloaded are counted
by :meth:`TieredStore.count_restore_skips`.

The store is assembled from parts handed what they use: :class:`~tiered_kv.store.host_slots.HostSlots`
(the host tier's slots as blocks), the lower tiers (:class:`~tiered_kv.store.encoded_tier.EncodedTier`,
opened from ``config.lower_tiers``), a :class:`~tiered_kv.store.saving.Saver` and a
:class:`~tiered_kv.store.loading.Loader`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from math import prod

import torch

from storage_backends.host import HostBackend
from tiered_kv.config import TieredKVConfig
from tiered_kv.dtypes import itemsize
from tiered_kv.errors import BackendClosed, ConfigError
from tiered_kv.keys import Namespace, leading_present
from tiered_kv.store import codec_choice
from tiered_kv.store.admission import RequestCounts
from tiered_kv.store.block_events import BlockEvents
from tiered_kv.store.closing import close_parts, close_store
from tiered_kv.store.cost_records import COSTS_SAVE_S, CostsKeeper
from tiered_kv.store.encoded_tier import EncodedTier
from tiered_kv.store.flushing import drain_writes, flush_tiers
from tiered_kv.store.host_copy import HostCopier
from tiered_kv.store.host_slots import HostSlots
from tiered_kv.store.invalidation import Invalidations
from tiered_kv.store.layer_frames import smallest_frame
from tiered_kv.store.loading import Loader, LoadPlan
from tiered_kv.store.lower_reads import LowerReader
from tiered_kv.store.lower_tiers import open_media
from tiered_kv.store.metrics import StoreMetrics
from tiered_kv.store.presence import RankedPresence, rank_prefixes
from tiered_kv.store.records import RecordKeeper
from tiered_kv.store.restore_costs import RestoreCosts
from tiered_kv.store.saving import SaveBatch, Saver
from tiered_kv.store.stats_log import StatsLogger
from tiered_kv.store.transfer import TransferPool
from tiered_kv.units import format_size

__all__ = ["LoadPlan", "SaveBatch", "TieredStore"]

log = logging.getLogger(__name__)


class TieredStore:
    """All tiers of one namespace (one model shard) in one process."""

    def __init__(self, config: TieredKVConfig, namespace: Namespace) -> None:
        self.config = config
        self.namespace = namespace
        block_nbytes = itemsize(namespace.dtype) * prod(namespace.block_shape)
        for field, size in (("host.capacity", config.host.capacity), ("host.tenant_quota", config.host.tenant_quota),
                            *_lower_quotas(config)):
            if size is not None and size < block_nbytes:  # (a quota under it: no tenant's block was kept)
                raise ConfigError(f"{field} {format_size(size)} holds no block of {format_size(block_nbytes)}")
        self.metrics = StoreMetrics()
        self.pool = TransferPool(config.workers, config.max_inflight_save, config.max_inflight_load)
        # a part that fails to start stops those started before it (a host slab refused left the
        # pool's threads running; a tier refused, e.g. for its secret, left every medium open)
        media: list = []
        try:
            self.copier = HostCopier(config.workers)  # large host<->caller batches on several threads
            evicting = any(t.policy == "on_evict" for t in config.lower_tiers)
            quota = {"tenant_quota": config.host.tenant_quota} if config.host.tenant_quota else {}
            self.host = HostBackend(capacity=config.host.capacity, slot_bytes=block_nbytes,
                                    pinned=config.host.pinned,
                                    on_evict=self._on_host_evict if evicting else None, **quota)
            self.slots = HostSlots(self.host, namespace, self.copier)
            media = open_media(config)
            frame = smallest_frame(namespace, block_nbytes, config.layer_groups)  # what "auto" is measured on
            self.tiers = [EncodedTier(tier, backend, namespace, self.metrics,
                                      codec_choice.choose(tier.codec, config.workers, frame_bytes=frame),
                                      config.layer_groups, config.encryption_secret)
                          for tier, backend in media]
        except BaseException:
            self.close_parts([backend for _, backend in media])
            raise
        try:
            # which tier holds which blocks, for subscribers (tiered_kv.store.block_events)
            self.events = BlockEvents()
            self.host.listen(self.events.listener("host"))
            for tier in self.tiers:  # (other ranks' copies it evicts: .block_events)
                tier.backend.listen(self.events.listener(tier.name, tier.ns, rank_prefixes(namespace)))
            self.presence = RankedPresence(namespace, [(t.name, t.backend) for t in self.tiers],
                                           config.lookup_timeout, self.metrics.miss)
            self.invalidations = Invalidations(self.host, self.tiers, self.pool, self.metrics)
            self.requests = RequestCounts([t.config.admit_after_hits for t in self.tiers])
            self.saver = Saver(self.slots, self.tiers, self.pool, self.metrics, self.invalidations,
                               RecordKeeper(namespace), self.requests, config.workers, namespace.tenant)
            reader = LowerReader(self.tiers, self.invalidations, self.saver, self.metrics, block_nbytes)
            self.loader = Loader(self.slots, self.tiers, self.pool, self.metrics, self.invalidations,
                                 self.saver, reader, config.workers)
            self.costs = RestoreCosts(config.restore_min_samples)
            written = [(t.name, t.backend) for t in self.tiers if t.policy != "off"]  # (never ``off`` ones)
            self.cost_record = CostsKeeper(self.costs, namespace, written, writes=True, every=COSTS_SAVE_S)
            self._closed = False
            self._close_lock = threading.Lock()
            self._metrics_ports: list[int] = []  # Prometheus exporter ports serving this store
            if config.metrics_port is not None:
                _export_metrics(self, config.metrics_port)
            self._stats_log = (StatsLogger(self, config.metrics_log_interval)
                               if config.metrics_log_interval else None)
        except BaseException:  # (e.g. metrics_port without prometheus-client): nothing left running
            for part in (getattr(self, "cost_record", None), getattr(self, "presence", None)):
                if part is not None:
                    part.close()
            if getattr(self, "_metrics_ports", None):  # (its exporter served a store never made)
                from tiered_kv.store.prometheus import unexport
                unexport(self)
            self.close_parts()
            raise
        log.info("tiered store for %s: block %s %s = %s; tiers: host%s", namespace.model_id,
                 self.shape, namespace.dtype, format_size(block_nbytes),
                 "".join(f", {t.name} ({t.backend.url})" for t in self.tiers))

    # -- the parts -------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """Canonical block shape ``[num_layers, 2, block_size, num_kv_heads, head_dim]``."""
        return self.slots.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.slots.dtype

    @property
    def block_nbytes(self) -> int:
        return self.slots.block_nbytes

    def tier(self, name: str) -> EncodedTier | None:
        """The lower tier called ``name`` (None when it is not configured)."""
        return next((t for t in self.tiers if t.name == name), None)

    def slot_tensor(self, slot: int) -> torch.Tensor:
        """Host slot ``slot`` as a canonical block tensor (shares memory with the slab)."""
        return self.slots.slot_tensor(slot)

    # -- saving and loading (see Saver and Loader) -------------------------------------------------
    def prepare_save(self, keys: Sequence[bytes], tenant: bytes | None = None) -> SaveBatch:
        if self._after_close(len(keys)):
            return SaveBatch([], [], len(keys))
        return self.saver.prepare_save(keys, tenant)

    def commit_save(self, batch: SaveBatch, ok: bool = True):
        if ok and self._after_close(len(batch.keys)):
            return None
        return self.saver.commit_save(batch, ok)

    def save(self, keys: Sequence[bytes], payloads: Sequence[torch.Tensor], tenant: bytes | None = None,
             wait: float | None = None):
        if self._after_close(len(keys)):
            return None
        return self.saver.save(keys, payloads, tenant, wait)

    def _after_close(self, n: int) -> bool:
        """Whether the store is closed: a save of ``n`` blocks then is a counted drop
        (``saves_after_close``; an engine shutting down never gets an error for it). It used to
        count the blocks as written to the host tier, and store nothing."""
        if self._closed:
            self.metrics.event("saves_after_close", n)
        return self._closed

    def prepare_load(self, keys: Sequence[bytes], tenant: bytes | None = None, *, count: bool = True) -> LoadPlan:
        return self.loader.prepare_load(keys, tenant, count=count)

    def lease(self, lease_id: str, keys: Sequence[bytes], tenant: bytes | None = None) -> LoadPlan:
        return self.loader.lease(lease_id, keys, tenant)

    def take_lease(self, lease_id: str, keys: Sequence[bytes], tenant: bytes | None = None) -> LoadPlan:
        return self.loader.take_lease(lease_id, keys, tenant)

    def drop_lease(self, lease_id: str) -> None:
        self.loader.drop_lease(lease_id)

    def load(self, plan: LoadPlan) -> LoadPlan:
        return self.loader.load(plan)

    def release(self, plan: LoadPlan) -> None:
        self.loader.release(plan)

    def load_into(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> list[bool]:
        return self.loader.load_into(keys, outs)

    def _on_host_evict(self, key: bytes, value: memoryview, tenant: bytes) -> None:
        self.saver.on_host_evict(key, value, tenant)

    # -- lookup ----------------------------------------------------------------------------------
    def locate(self, keys: Sequence[bytes], *, host: bool = True) -> list[str | None]:
        """The first tier holding this rank's copy of each key (None: nowhere; ``host``: whether
        the host tier counts). No side effects; each lower tier answers within
        ``lookup_timeout`` or counts as a miss; a closed store holds nothing, nor does a key being
        withdrawn (:meth:`invalidate`), as for :meth:`lookup`."""
        on_host = self._on_host(keys)
        if on_host is None:
            return [None] * len(keys)
        where = self.presence.locate(keys, on_host if host else None, own_only=True)[0]
        return [None if w else at for at, w in zip(where, self.invalidations.suppressed(keys))]

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether every tensor-parallel rank can load each of ``keys`` (not a leading run: the
        state entries of a hybrid model are looked up one by one). Same rules as :meth:`lookup`."""
        withdrawn = self.invalidations.suppressed(keys)
        on_host = self._on_host(keys)
        held = [False] * len(keys) if on_host is None else self.presence.locate(keys, on_host)[1]
        return [h and not w for h, w in zip(held, withdrawn)]

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` every tensor-parallel rank can load (this rank from any
        tier, the others from the shared lower tiers). Side-effect free, bounded in time; keys
        being withdrawn (:meth:`invalidate`) count as absent."""
        keys = keys[: leading_present([not w for w in self.invalidations.suppressed(keys)])]
        on_host = self._on_host(keys)
        return 0 if on_host is None else self.presence.lookup(keys, on_host)

    def _on_host(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Which ``keys`` the host tier holds; None once the store is closed: a lookup then finds
        nothing, counted ``lookups_after_close`` (a scheduler still stepping while its engine
        shuts down got ``BackendClosed``)."""
        try:
            if not self._closed:
                return self.host.contains_many(keys)
        except BackendClosed:
            if not self._closed:
                raise
        self.metrics.event("lookups_after_close", len(keys))
        return None

    def count_restore_skips(self, blocks: dict[str, int], tokens: int, probe: bool = False) -> None:
        """The restore policy left ``blocks`` (per tier) unloaded, ``tokens`` tokens, as slower
        than recomputing (misses ``slower_than_recompute``, event ``restore_skipped_tokens``);
        ``probe``: it loaded blocks predicted slower, to refresh the estimates (``restore_probes``)."""
        for tier, n in blocks.items():
            self.metrics.miss(tier, "slower_than_recompute", n)
        if tokens:
            self.metrics.event("restore_skipped_tokens", tokens)
        if probe:
            self.metrics.event("restore_probes")

    def invalidate(self, keys: Sequence[bytes]):
        """Withdraw every copy of ``keys`` from every tier (their KV may be wrong); see
        :mod:`tiered_kv.store.invalidation`. Returns a future done when the lower tiers are clean
        (or a tier that failed to delete them is retried, the keys withdrawn meanwhile)."""
        return self.invalidations.invalidate(keys)

    # -- lifecycle ---------------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued write-behind and copies up (:func:`~tiered_kv.store.flushing.drain_writes`),
        write the cost estimates when they moved and make the lower tiers durable (those that can
        be); False when a write was still running after ``timeout`` seconds."""
        done = drain_writes(self.pool, self.loader.reader.copies, timeout)
        self.cost_record.save()
        flush_tiers(self.tiers)
        return done

    def stats(self) -> dict:
        snap = self.metrics.snapshot()
        snap["backends"] = {"host": self.host.stats().as_dict()}
        snap["codecs"] = {tier.name: tier.codec.codec for tier in self.tiers}  # "auto" as resolved
        for tier in self.tiers:
            try:
                snap["backends"][tier.name] = tier.backend.stats().as_dict()
            except Exception as exc:  # a down remote must not break stats
                snap["backends"][tier.name] = {"error": str(exc)}
        snap["queued_bytes"] = self.pool.queued_bytes()
        return snap

    def close(self) -> None:
        """Flush and close every part; a tier that does not answer is waited for at most
        ``config.close_timeout`` (:mod:`~tiered_kv.store.closing`)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:  # (one of these raising left the pool, the media and the exporter open for good)
            if self._stats_log is not None:
                self._stats_log.close()
            self.cost_record.close()  # (flush writes the record once more)
            self.loader.release_leases()
        finally:
            close_store(self, self.config.close_timeout)

    def close_parts(self, media: Sequence = ()) -> None:
        """Stop the pool and close every medium (also when starting a later part failed;
        ``media``: those opened before their tiers were made)."""
        close_parts(self, media)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _lower_quotas(config: TieredKVConfig) -> list[tuple[str, int]]:
    """(setting, bytes) of every tenant quota of the lower tiers, as their media get them (a put
    over a quota below one block is refused: that tenant's blocks were refused for good, seen
    only as ``put_rejected``)."""
    out = []
    for tier in config.lower_tiers:
        quotas = tier.quotas()
        if quotas.default is not None:
            out.append((f"{tier.name}.tenant_quota", quotas.default))
        out += [(f"{tier.name}.options.tenant_quotas[{label!r}]", size) for label, size in quotas.per_tenant.items()]
    return out


def _export_metrics(store: TieredStore, port: int) -> None:
    try:
        from tiered_kv.store.prometheus import export
    except ImportError as exc:
        raise ConfigError(f"metrics_port needs prometheus-client (pip install 'tiered-kv[metrics]'): {exc}") from None
    export(store, port)
