"""Prometheus export of the store's counters, and the summary ``tiered-kv stats`` prints.

A store whose config sets ``metrics_port`` registers with the exporter of that port (one HTTP
server per port and process, shared by the stores of that process: one per model shard). Each
scrape reads :meth:`StoreMetrics.snapshot`, the transfer queues and the figures of the media
that keep them in memory (host, LMDB); nothing here touches Redis or walks a directory.

Metric families (labels ``namespace``, ``model`` on all of them):

- ``tiered_kv_hits_total{tier}``, ``tiered_kv_misses_total{tier,reason}`` — blocks;
- ``tiered_kv_blocks_total{tier,direction}``, ``tiered_kv_bytes_total{tier,direction}`` (payload
  bytes), ``tiered_kv_stored_bytes_total{tier}`` (as stored, written),
  ``tiered_kv_transfer_seconds_total{tier,direction}`` — direction ``in`` (written to the tier)
  or ``out`` (read from it);
- ``tiered_kv_evictions_total{tier}``, ``tiered_kv_dropped_saves_total``,
  ``tiered_kv_events_total{event}`` (saves_dropped, loads_failed, disk_save_failed, ...);
- ``tiered_kv_queued_bytes{direction}`` (save / load), ``tiered_kv_tier_entries{tier}``,
  ``tiered_kv_tier_used_bytes{tier}``, ``tiered_kv_tier_capacity_bytes{tier}``.
"""

from __future__ import annotations

import base64
import logging
import threading
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlsplit

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from storage_backends.base import Backend
from storage_backends.redaction import redact_text, redact_url
from tiered_kv.errors import BackendUnavailable, ConfigError
from tiered_kv.keys import Namespace
from tiered_kv.store.metrics import StoreMetrics
from tiered_kv.store.transfer import TransferPool


class MetricSource(Protocol):
    """What the exporter reads of a store (:class:`tiered_kv.store.MetricSource` is one)."""

    namespace: Namespace  # labels
    metrics: StoreMetrics  # counters
    pool: TransferPool  # queued bytes
    host: Backend  # the host tier's figures
    tiers: list  # lower tiers: ``name`` and ``backend`` each
    _metrics_ports: list[int]  # the ports serving it (kept by export / unexport)

log = logging.getLogger(__name__)

CHEAP_MEDIA = ("host", "lmdb")  # stats() without network or directory walks
_servers: dict[int, tuple] = {}  # port -> (server, thread, collector)
_lock = threading.Lock()


class StoreCollector(Collector):
    """Collects every registered store's counters at scrape time."""

    def __init__(self) -> None:
        self._stores: dict[int, MetricSource] = {}
        self._lock = threading.Lock()

    def add(self, store: MetricSource) -> None:
        with self._lock:
            self._stores[id(store)] = store

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
            "evictions": CounterMetricFamily("tiered_kv_evictions", "Blocks evicted", labels=base + ["tier"]),
            "dropped": CounterMetricFamily("tiered_kv_dropped_saves", "Saves dropped (write-behind full)",
                                           labels=base),
            "events": CounterMetricFamily("tiered_kv_events", "Store events", labels=base + ["event"]),
            "queued": GaugeMetricFamily("tiered_kv_queued_bytes", "Bytes queued or in flight",
                                        labels=base + ["direction"]),
            "entries": GaugeMetricFamily("tiered_kv_tier_entries", "Values a tier holds", labels=base + ["tier"]),
            "used": GaugeMetricFamily("tiered_kv_tier_used_bytes", "Bytes a tier holds", labels=base + ["tier"]),
            "capacity": GaugeMetricFamily("tiered_kv_tier_capacity_bytes", "Byte capacity of a tier",
                                          labels=base + ["tier"]),
        }
        for store in stores:
            try:
                _collect_store(store, fam)
            except Exception as exc:  # a closing store must not break the scrape
                log.debug("metrics of a store skipped: %r", exc)
        yield from fam.values()


def _collect_store(store: MetricSource, fam: dict) -> None:
    ids = [store.namespace.digest().hex()[:16], store.namespace.model_id]
    snap = store.metrics.snapshot()
    evictions: dict[str, int] = defaultdict(int)
    for tier, t in snap["tiers"].items():
        fam["hits"].add_metric(ids + [tier], t["hits"])
        for reason, n in t["misses"].items():
            fam["misses"].add_metric(ids + [tier, reason], n)
        for direction in ("in", "out"):
            fam["blocks"].add_metric(ids + [tier, direction], t[f"blocks_{direction}"])
            fam["bytes"].add_metric(ids + [tier, direction], t[f"bytes_{direction}"])
            fam["seconds"].add_metric(ids + [tier, direction], t[f"seconds_{direction}"])
        fam["stored"].add_metric(ids + [tier], t["stored_bytes_in"])
        evictions[tier] += t["evictions"]
    for name, n in snap["events"].items():
        fam["events"].add_metric(ids + [name], n)
    fam["dropped"].add_metric(ids, snap["events"].get("saves_dropped", 0))
    for direction, n in store.pool.queued_bytes().items():
        fam["queued"].add_metric(ids + [direction], n)
    media = [("host", store.host)] + [(t.name, t.backend) for t in store.tiers]
    for tier, backend in media:
        if backend.name not in CHEAP_MEDIA:
            continue
        try:
            stats = backend.stats()
        except BackendUnavailable:
            continue
        evictions[tier] += stats.evictions
        fam["entries"].add_metric(ids + [tier], stats.entries)
        fam["used"].add_metric(ids + [tier], stats.used_bytes)
        if stats.capacity_bytes is not None:
            fam["capacity"].add_metric(ids + [tier], stats.capacity_bytes)
    for tier, n in evictions.items():
        fam["evictions"].add_metric(ids + [tier], n)


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


# -- reading metrics back (tiered-kv stats) ------------------------------------------------------
def fetch(target: str, timeout: float = 5.0) -> str:
    """Metrics text from an exporter URL (``host:port`` is enough) or a saved file."""
    if Path(target).is_file():
        return Path(target).read_text()
    url = target if "://" in target else f"http://{target}"
    if url.split("://", 1)[1].count("/") == 0:
        url += "/metrics"
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"metrics URL must be http(s)://HOST:PORT[/metrics] or a file, got {redact_url(target)!r}")
    try:
        with urllib.request.urlopen(_request(url), timeout=timeout) as response:
            return response.read().decode()
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = redact_text(str(getattr(exc, "reason", exc)), url)
        raise BackendUnavailable(f"cannot fetch metrics from {redact_url(url)}: {reason}") from None


def _request(url: str) -> urllib.request.Request:
    """A request for ``url``; ``user:password@`` in it becomes a basic-auth header (urllib would
    take it for a host name)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return urllib.request.Request(url)
    host = parts.netloc.rpartition("@")[2]
    token = base64.b64encode(f"{unquote(parts.username or '')}:{unquote(parts.password or '')}".encode())
    return urllib.request.Request(parts._replace(netloc=host).geturl(),
                                  headers={"Authorization": "Basic " + token.decode()})


def summarize(text: str) -> dict:
    """Per tier: hits, misses by reason, blocks / bytes / seconds per direction, evictions,
    entries; store-wide: events and queued bytes (summed over namespaces)."""
    tiers: dict[str, dict] = defaultdict(lambda: {"hits": 0, "misses": defaultdict(float), "in": defaultdict(float),
                                                  "out": defaultdict(float), "evictions": 0})
    events: dict[str, float] = defaultdict(float)
    queued: dict[str, float] = defaultdict(float)
    namespaces = set()
    seen = False
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"not Prometheus metrics text: {exc}") from None
    for family in families:
        for s in family.samples:
            if not s.name.startswith("tiered_kv_") or s.name.endswith("_created"):
                continue
            seen = True
            lab = s.labels
            namespaces.add((lab.get("namespace"), lab.get("model")))
            name, tier = s.name, lab.get("tier")
            if name == "tiered_kv_hits_total":
                tiers[tier]["hits"] += s.value
            elif name == "tiered_kv_misses_total":
                tiers[tier]["misses"][lab["reason"]] += s.value
            elif name in ("tiered_kv_blocks_total", "tiered_kv_bytes_total", "tiered_kv_transfer_seconds_total"):
                what = name[len("tiered_kv_"):-len("_total")].replace("transfer_", "")
                tiers[tier][lab["direction"]][what] += s.value
            elif name == "tiered_kv_evictions_total":
                tiers[tier]["evictions"] += s.value
            elif name in ("tiered_kv_tier_entries", "tiered_kv_tier_used_bytes", "tiered_kv_tier_capacity_bytes"):
                key = name[len("tiered_kv_tier_"):]
                tiers[tier][key] = tiers[tier].get(key, 0) + s.value
            elif name == "tiered_kv_events_total":
                events[lab["event"]] += s.value
            elif name == "tiered_kv_queued_bytes":
                queued[lab["direction"]] += s.value
    if not seen:
        raise ConfigError("no tiered_kv metrics in that text (is it a tiered-kv exporter?)")
    out = {}
    for name, t in sorted(tiers.items()):
        row = {"hits": int(t["hits"]), "misses": {r: int(n) for r, n in sorted(t["misses"].items())},
               "evictions": int(t["evictions"])}
        total = row["hits"] + sum(row["misses"].values())
        row["hit_rate"] = round(row["hits"] / total, 4) if total else None
        for direction in ("in", "out"):
            d = t[direction]
            secs = d.get("seconds", 0.0)
            row[direction] = {"blocks": int(d.get("blocks", 0)), "bytes": int(d.get("bytes", 0)),
                              "seconds": round(secs, 6),
                              "mb_per_s": round(d.get("bytes", 0) / secs / 1e6, 1) if secs else None}
        for key in ("entries", "used_bytes", "capacity_bytes"):
            if key in t:
                row[key] = int(t[key])
        out[name] = row
    return {"namespaces": [{"namespace": n, "model": m} for n, m in sorted(namespaces, key=str)],
            "tiers": out, "events": {k: int(v) for k, v in sorted(events.items())},
            "queued_bytes": {k: int(v) for k, v in sorted(queued.items())}}
