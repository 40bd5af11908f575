"""TieredStore: the host tier plus optional disk and remote tiers, with async transfers.

Lifecycle of a block:

- **save**: ``prepare_save(keys)`` reserves host slots (phase one, invisible), the caller fills
  them (``slot_tensor``), ``commit_save`` makes them visible (phase two) or rolls them back, and
  queues write-behind to the lower tiers whose policy is ``write_through`` (``on_evict`` tiers
  get a block when the host tier evicts it). Saves over the in-flight budget are dropped from
  write-behind and counted (the host copy stays).
- **lookup(keys)**: the number of leading keys present in some tier; no side effects.
- **load**: ``prepare_load(keys)`` leases the blocks (host pins, disk pins), ``load(plan)``
  runs in the pool: host hits are ready at once, disk/remote hits are validated and decoded into
  freshly reserved host slots (promotion) and leased to the caller; ``release(plan)`` ends the
  lease. Failures are per block with a counted reason; nothing unvalidated is handed out.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from storage_backends.host import HostBackend
from storage_backends.registry import open_backend
from tiered_kv.store.host_slots import SlotViews, block_shape, torch_dtype
from tiered_kv.store.codec import BlockCodec
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import ConfigError
from tiered_kv.store.host_copy import HostCopier
from tiered_kv.store.invalidation import Invalidations
from tiered_kv.keys import Namespace
from tiered_kv.store.loading import LoadPath, LoadPlan
from tiered_kv.store.metrics import StoreMetrics
from tiered_kv.store.presence import RankedPresence
from tiered_kv.store.saving import SaveBatch, SavePath
from tiered_kv.store.stats_log import StatsLogger
from tiered_kv.store.encoded_tier import EncodedTier
from tiered_kv.store.transfer import TransferPool
from tiered_kv.units import format_size

__all__ = ["LoadPlan", "SaveBatch", "TieredStore", "block_shape", "torch_dtype"]

log = logging.getLogger(__name__)


class TieredStore(SavePath, LoadPath, SlotViews):
    """All tiers of one namespace (one model shard) in one process. Saving is
    :class:`SavePath`, loading :class:`LoadPath`, slot tensors :class:`SlotViews`."""

    def __init__(self, config: TieredKVConfig, namespace: Namespace) -> None:
        self.config = config
        self.namespace = namespace
        self.shape = block_shape(namespace)
        self.dtype = torch_dtype(namespace.dtype)
        self.block_nbytes = self.dtype.itemsize
        for d in self.shape:
            self.block_nbytes *= d
        if config.host.capacity < self.block_nbytes:
            raise ConfigError(f"host.capacity {format_size(config.host.capacity)} holds no block of "
                              f"{format_size(self.block_nbytes)}")
        self.metrics = StoreMetrics()
        self.pool = TransferPool(config.workers, config.max_inflight_save, config.max_inflight_load)
        self.copier = HostCopier(config.workers)  # large host<->caller batches on several threads
        on_evict = [t for t in ("disk", "remote")
                    if getattr(config, t).url and getattr(config, t).policy == "on_evict"]
        self.host = HostBackend(capacity=config.host.capacity, slot_bytes=self.block_nbytes,
                                pinned=config.host.pinned,
                                on_evict=self._on_host_evict if on_evict else None)
        self._slot_views: list[torch.Tensor | None] = [None] * self.host.num_slots
        self._slot_rows = self.host.slab.numpy()  # [slot, byte]: host copies without torch ops
        self.disk = self._open_tier("disk", config.disk.url, capacity=config.disk.capacity,
                                    sync=config.disk.sync)
        self.remote = self._open_tier("remote", config.remote.url, ttl=config.remote.ttl,
                                      timeout=config.remote.timeout, retries=config.remote.retries)
        self.lower = [t for t in (self.disk, self.remote) if t is not None]
        self.presence = RankedPresence(namespace, [(t.name, t.backend) for t in self.lower],
                                       config.lookup_timeout, self.metrics.miss)
        self.invalidations = Invalidations(self.host, self.lower, self.pool, self.metrics)
        self._record_due: dict[str, float] = {}  # tier -> when to check its namespace record
        self._lock = threading.Lock()
        self._leases: dict[str, LoadPlan] = {}
        self._closed = False
        self._metrics_ports: list[int] = []  # Prometheus exporter ports serving this store
        if config.metrics_port is not None:
            _export_metrics(self, config.metrics_port)
        self._stats_log = (StatsLogger(self, config.metrics_log_interval)
                           if config.metrics_log_interval else None)
        log.info("tiered store for %s: block %s %s = %s; tiers: host%s", namespace.model_id,
                 self.shape, namespace.dtype, format_size(self.block_nbytes),
                 "".join(f", {t.name} ({t.backend.url})" for t in self.lower))

    def _open_tier(self, name: str, url: str | None, **options) -> EncodedTier | None:
        if not url:
            return None
        section = getattr(self.config, name)
        backend = open_backend(url, **options)
        codec = BlockCodec(section.codec, section.level)
        return EncodedTier(name, backend, codec, self.namespace, self.shape, self.metrics, section.policy)

    # -- lookup ----------------------------------------------------------------------------------
    def locate(self, keys: Sequence[bytes]) -> list[str | None]:
        """The first tier holding this rank's copy of each key (None: nowhere). No side effects;
        each lower tier answers within ``lookup_timeout`` or counts as a miss."""
        return self.presence.locate(keys, self.host.contains_many(keys))[0]

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` every tensor-parallel rank can load (this rank from any
        tier, the others from the shared lower tiers). Side-effect free, bounded in time; keys
        being withdrawn (:meth:`invalidate`) count as absent."""
        withdrawn = self.invalidations.suppressed(keys)
        if any(withdrawn):
            keys = keys[: withdrawn.index(True)]
        return self.presence.lookup(keys, self.host.contains_many(keys))

    def invalidate(self, keys: Sequence[bytes]):
        """Withdraw every copy of ``keys`` from every tier (their KV may be wrong); see
        :mod:`tiered_kv.store.invalidation`. Returns a future done when the lower tiers are clean."""
        return self.invalidations.invalidate(keys)

    # -- lifecycle ---------------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued write-behind and make the disk tier durable."""
        done = self.pool.drain(timeout)
        if self.disk is not None:
            self.disk.backend.flush()
        return done

    def stats(self) -> dict:
        snap = self.metrics.snapshot()
        snap["backends"] = {"host": self.host.stats().as_dict()}
        for tier in self.lower:
            try:
                snap["backends"][tier.name] = tier.backend.stats().as_dict()
            except Exception as exc:  # a down remote must not break stats
                snap["backends"][tier.name] = {"error": str(exc)}
        snap["queued_bytes"] = self.pool.queued_bytes()
        return snap

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._stats_log is not None:
            self._stats_log.close()
        with self._lock:
            leases, self._leases = list(self._leases.values()), {}
        for plan in leases:
            self.release(plan)
        try:
            self.flush()
        finally:
            if self._metrics_ports:
                from tiered_kv.store.prometheus import unexport

                unexport(self)
            self.pool.close()
            self.copier.close()
            self.presence.close()
            for tier in self.lower:
                tier.backend.close()
            self.host.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _export_metrics(store: TieredStore, port: int) -> None:
    try:
        from tiered_kv.store.prometheus import export
    except ImportError as exc:
        raise ConfigError(f"metrics_port needs prometheus-client (pip install 'tiered-kv[metrics]'): {exc}") from None
    export(store, port)
