"""Prometheus export of the store's counters (``tiered-kv stats`` reads them back:
:mod:`tiered_kv.admin.stats`).

A store whose config sets ``metrics_port`` registers with the exporter of that port (one HTTP
server per port and process, shared by the stores of that process: one per model shard). Each
scrape reads :meth:`StoreMetrics.snapshot`, the transfer queues and the figures of the media
that keep them at hand (host: counts kept in memory, no scan of its entries; LMDB: its ``info`` and
``tenants`` tables, through ``figures()``); nothing here touches Redis, walks a directory or
stats a file.

Metric families (labels ``namespace``, ``model`` on all of them; a second store of the same
namespace and model on one exporter, open beside the first, adds ``store="2"`` (``"3"``, ...) to
each of its series: they repeated the first store's, Prometheus kept the first of each pair (the
second store's counts were lost), and once the first store closed the same series went on with
the second's counts, down or up):

- ``tiered_kv_hits_total{tier}``, ``tiered_kv_misses_total{tier,reason}`` — blocks;
- ``tiered_kv_blocks_total{tier,direction}``, ``tiered_kv_bytes_total{tier,direction}`` (payload
  bytes), ``tiered_kv_stored_bytes_total{tier}`` (as stored, written),
  ``tiered_kv_transfer_seconds_total{tier,direction}`` — direction ``in`` (written to the tier)
  or ``out`` (read from it);
- ``tiered_kv_evictions_total{tier}`` (what the tier's medium counted: the entries this process
  evicted to make room, for every medium; Redis' own ``maxmemory`` evictions are not seen),
  ``tiered_kv_dropped_saves_total``,
  ``tiered_kv_events_total{event}`` (saves_dropped, loads_failed, disk_save_failed, ...);
- ``tiered_kv_queued_bytes{direction}`` (save / load), ``tiered_kv_tier_entries{tier}``,
  ``tiered_kv_tier_used_bytes{tier}``, ``tiered_kv_tier_capacity_bytes{tier}``;
- ``tiered_kv_tier_up{tier}`` (1 / 0: a Redis tier whose circuit breaker is open is 0; read
  from memory, no network);
- ``tiered_kv_quota_evictions_total{tier}``, ``tiered_kv_tenant_used_bytes{tier,tenant}`` (the
  tenant's 8-byte label in hex, ``-`` for none; the :data:`TENANT_SERIES` tenants holding the
  most bytes of a tier each, the rest summed as ``other``, so that a salt per user does not make a
  series per user); admission's skipped writes are the event ``admission_skipped``;
- cost-aware restore: ``tiered_kv_restore_skipped_tokens_total`` (stored tokens the restore policy
  left to recompute; their blocks are ``tiered_kv_misses_total{reason="slower_than_recompute"}``
  in the tier that held them, its probes the event ``restore_probes``), and the estimates it
  weighs: ``tiered_kv_restore_latency_seconds{tier}``, ``tiered_kv_restore_throughput_bytes{tier}``
  (per second; absent while unbounded), ``tiered_kv_prefill_seconds{term}`` (``step``: per step,
  ``token``: per new token, ``pair``: per attention pair), ``tiered_kv_cost_observations{source}``
  (restores per tier, ``steps``).
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Protocol

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from storage_backends.base import Backend, BackendStats
from tiered_kv.errors import BackendUnavailable
from tiered_kv.keys import Namespace
from tiered_kv.store.metrics import StoreMetrics
from tiered_kv.store.transfer import TransferPool


class MetricSource(Protocol):
    """What the exporter reads of a store (:class:`tiered_kv.store.TieredStore` is one)."""

    namespace: Namespace  # labels
    metrics: StoreMetrics  # counters
    pool: TransferPool  # queued bytes
    host: Backend  # the host tier's figures
    tiers: list  # lower tiers: ``name`` and ``backend`` each
    _metrics_ports: list[int]  # the ports serving it (kept by export / unexport)
    # optional: ``costs`` (a RestoreCosts): the restore and prefill estimates

log = logging.getLogger(__name__)

CHEAP_MEDIA = ("host", "lmdb")  # figures without network, directory walks or scans (:func:`_figures`)
TENANT_SERIES = 32  # tenants with a series of their own per tier; the rest are summed as "other"
OTHER_TENANTS = "other"
_servers: dict[int, tuple] = {}  # port -> (server, thread, collector)
_lock = threading.Lock()


class StoreCollector(Collector):
    """Collects every registered store's counters at scrape time."""

    def __init__(self) -> None:
        self._stores: dict[int, tuple[MetricSource, int]] = {}  # id -> (store, its copy number)
        self._lock = threading.Lock()

    def add(self, store: MetricSource) -> None:
        with self._lock:
            if id(store) in self._stores:
                return
            # the lowest copy number free among the open stores of its namespace and model, kept
            # for its life: a number passed on when another closes would join two stores' counts
            ids = _ids(store)
            taken = {copy for other, copy in self._stores.values() if _ids(other) == ids}
            self._stores[id(store)] = (store, next(n for n in itertools.count(1) if n not in taken))

    def remove(self, store: MetricSource) -> int:
        with self._lock:
            self._stores.pop(id(store), None)
            return len(self._stores)

    def collect(self):
        with self._lock:
            stores = list(self._stores.values())
        base = ["namespace", "model"]
        fam = {
            "hits": CounterMetricFamily("tiered_kv_hits", "Blocks served from a tier", labels=base + ["tier"]),
            "misses": CounterMetricFamily("tiered_kv_misses", "Blocks a tier did not serve, by reason",
                                          labels=base + ["tier", "reason"]),
            "blocks": CounterMetricFamily("tiered_kv_blocks", "Blocks moved", labels=base + ["tier", "direction"]),
            "bytes": CounterMetricFamily("tiered_kv_bytes", "Payload bytes moved", labels=base + ["tier", "direction"]),
            "stored": CounterMetricFamily("tiered_kv_stored_bytes", "Bytes written as stored (compressed)",
                                          labels=base + ["tier"]),
            "seconds": CounterMetricFamily("tiered_kv_transfer_seconds", "Time spent moving blocks",
                                           labels=base + ["tier", "direction"]),
            "evictions": CounterMetricFamily("tiered_kv_evictions", "Entries this process evicted from a tier to "
                                             "make room (not those Redis drops by its own policy)",
                                             labels=base + ["tier"]),
            "dropped": CounterMetricFamily("tiered_kv_dropped_saves", "Saves dropped (write-behind full)",
                                           labels=base),
            "events": CounterMetricFamily("tiered_kv_events", "Store events", labels=base + ["event"]),
            "queued": GaugeMetricFamily("tiered_kv_queued_bytes", "Bytes queued or in flight",
                                        labels=base + ["direction"]),
            "entries": GaugeMetricFamily("tiered_kv_tier_entries", "Values a tier holds", labels=base + ["tier"]),
            "used": GaugeMetricFamily("tiered_kv_tier_used_bytes", "Bytes a tier holds", labels=base + ["tier"]),
            "capacity": GaugeMetricFamily("tiered_kv_tier_capacity_bytes", "Byte capacity of a tier",
                                          labels=base + ["tier"]),
            "quota_evictions": CounterMetricFamily(
                "tiered_kv_quota_evictions", "Entries a tenant over its quota evicted of its own",
                labels=base + ["tier"]),
            "up": GaugeMetricFamily("tiered_kv_tier_up", "1 while a tier answers, 0 while it is "
                                    "counted unavailable (Redis: its circuit breaker is open)",
                                    labels=base + ["tier"]),
            "tenant_used": GaugeMetricFamily("tiered_kv_tenant_used_bytes",
                                             "Bytes a tier holds per tenant (cache_salt label, hex)",
                                             labels=base + ["tier", "tenant"]),
            "skipped_tokens": CounterMetricFamily("tiered_kv_restore_skipped_tokens",
                                                  "Stored tokens recomputed: predicted slower to restore",
                                                  labels=base),
            "latency": GaugeMetricFamily("tiered_kv_restore_latency_seconds",
                                         "Estimated latency of a restore from a tier", labels=base + ["tier"]),
            "throughput": GaugeMetricFamily("tiered_kv_restore_throughput_bytes",
                                            "Estimated bytes per second of a restore from a tier",
                                            labels=base + ["tier"]),
            "prefill": GaugeMetricFamily("tiered_kv_prefill_seconds", "Estimated prefill seconds per step, "
                                         "per new token and per attention pair", labels=base + ["term"]),
            "observations": GaugeMetricFamily("tiered_kv_cost_observations",
                                              "Restores (per tier) and engine steps the estimates rest on",
                                              labels=base + ["source"]),
        }
        for store, copy in stores:
            marks = {name: len(family.samples) for name, family in fam.items()}
            try:
                _collect_store(store, fam)
            except Exception as exc:  # a closing store must not break the scrape
                log.debug("metrics of a store skipped: %r", exc)
            if copy > 1:
                for name, family in fam.items():
                    family.samples[marks[name]:] = [s._replace(labels={**s.labels, "store": str(copy)})
                                                    for s in family.samples[marks[name]:]]
        yield from fam.values()


def _ids(store: MetricSource) -> list[str]:
    """The ``namespace`` and ``model`` labels of ``store``'s series."""
    return [store.namespace.digest().hex()[:16], store.namespace.model_id]


def _collect_store(store: MetricSource, fam: dict) -> None:
    ids = _ids(store)
    snap = store.metrics.snapshot()
    for tier, t in snap["tiers"].items():
        fam["hits"].add_metric(ids + [tier], t["hits"])
        for reason, n in t["misses"].items():
            fam["misses"].add_metric(ids + [tier, reason], n)
        for direction in ("in", "out"):
            fam["blocks"].add_metric(ids + [tier, direction], t[f"blocks_{direction}"])
            fam["bytes"].add_metric(ids + [tier, direction], t[f"bytes_{direction}"])
            fam["seconds"].add_metric(ids + [tier, direction], t[f"seconds_{direction}"])
        fam["stored"].add_metric(ids + [tier], t["stored_bytes_in"])
    for name, n in snap["events"].items():
        fam["events"].add_metric(ids + [name], n)
    fam["dropped"].add_metric(ids, snap["events"].get("saves_dropped", 0))
    fam["skipped_tokens"].add_metric(ids, snap["events"].get("restore_skipped_tokens", 0))
    _collect_costs(getattr(store, "costs", None), ids, fam)
    for direction, n in store.pool.queued_bytes().items():
        fam["queued"].add_metric(ids + [direction], n)
    media = [("host", store.host)] + [(t.name, t.backend) for t in store.tiers]
    for tier, backend in media:
        fam["up"].add_metric(ids + [tier], 1 if getattr(backend, "available", True) else 0)
        counted = _counters(backend)
        if counted is not None:  # (every medium: the figures it counts itself, in memory)
            fam["evictions"].add_metric(ids + [tier], counted.evictions)
            if "quota_evictions" in counted.extra:
                fam["quota_evictions"].add_metric(ids + [tier], counted.extra["quota_evictions"])
        if backend.name not in CHEAP_MEDIA:
            continue
        try:  # (a medium that cannot answer now leaves out its own figures, not the next tiers')
            stats, usage = backend.figures(), backend.tenant_usage() or {}
        except BackendUnavailable:
            continue
        fam["entries"].add_metric(ids + [tier], stats.entries)
        fam["used"].add_metric(ids + [tier], stats.used_bytes)
        if stats.capacity_bytes is not None:
            fam["capacity"].add_metric(ids + [tier], stats.capacity_bytes)
        for tenant, used in tenant_series(usage):
            fam["tenant_used"].add_metric(ids + [tier, tenant], used)


def _counters(backend: Backend) -> BackendStats | None:
    """What ``backend`` has counted so far (evictions, quota evictions, ...), read from memory
    without asking the medium anything: its ``stats()`` may be a network call (Redis) or walk a
    directory (file). The medium is the one place evictions are counted (it evicts on its own);
    None for a medium that is no :class:`Backend` (it keeps no such counters)."""
    counted = getattr(backend, "counters", None)
    return counted() if callable(counted) else None


def tenant_series(usage: dict[bytes, int]) -> list[tuple[str, int]]:
    """``(label, bytes)`` per series: the :data:`TENANT_SERIES` largest tenants by name (hex,
    ``-`` for none), then one ``other`` summing the rest (present once there is any rest)."""
    ranked = sorted(usage.items(), key=lambda item: (-item[1], item[0]))
    out = [(tenant.hex() or "-", used) for tenant, used in ranked[:TENANT_SERIES]]
    if len(ranked) > TENANT_SERIES:
        out.append((OTHER_TENANTS, sum(used for _, used in ranked[TENANT_SERIES:])))
    return out


def _collect_costs(costs, ids: list[str], fam: dict) -> None:
    """The restore and prefill estimates (whatever their observations: the floor is the policy's)."""
    if costs is None:
        return
    fam["observations"].add_metric(ids + ["steps"], costs.steps_observed())
    for source, n in costs.restores_observed().items():
        fam["observations"].add_metric(ids + [source], n)
        est = costs.restore_estimate(source)
        if est is not None:
            fam["latency"].add_metric(ids + [source], est.latency_s)
            if est.bytes_per_s is not None:
                fam["throughput"].add_metric(ids + [source], est.bytes_per_s)
    prefill = costs.prefill_estimate()
    if prefill is not None:
        for term, value in (("step", prefill.per_step_s), ("token", prefill.per_token_s),
                            ("pair", prefill.per_pair_s)):
            fam["prefill"].add_metric(ids + [term], value)


def export(store: MetricSource, port: int, addr: str = "0.0.0.0") -> int | None:
    """Serve ``store``'s metrics on ``port`` (shared with this process's other stores); the
    port actually bound, or None when it could not be (logged: metrics must not stop serving)."""
    with _lock:
        entry = _servers.get(port) if port else None
        if entry is None:
            collector = StoreCollector()
            registry = CollectorRegistry(auto_describe=False)
            registry.register(collector)
            try:
                server, thread = start_http_server(port, addr, registry)
            except OSError as exc:
                log.warning("metrics: cannot serve on %s:%d: %s", addr, port, exc)
                return None
            port = server.server_port
            entry = _servers[port] = (server, thread, collector)
            log.info("metrics: Prometheus exporter on %s:%d", addr, port)
        entry[2].add(store)
        store._metrics_ports.append(port)
        return port


def unexport(store: MetricSource) -> None:
    """Stop exporting ``store``; a server left without stores is shut down."""
    with _lock:
        for port in store._metrics_ports:
            entry = _servers.get(port)
            if entry is not None and entry[2].remove(store) == 0:
                del _servers[port]
                entry[0].shutdown()
                entry[0].server_close()
