"""SGLang adapter: tiered-kv as the L3 storage of SGLang's hierarchical cache (HiCache).

Attach by configuration only (SGLang 0.5.23)::

    python -m sglang.launch_server --model-path M --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "tiered_kv",
            "module_path": "tiered_kv.integrations.sglang", "class_name": "TieredKVHiCacheStorage",
            "interface_v1": 1, "disk": {"url": "lmdb:///var/cache/tiered-kv"}}'

The extra config carries SGLang's keys and ours side by side: tiered-kv's settings (``host``,
``disk``, ``remote``, ``workers``, … of :class:`~tiered_kv.config.TieredKVConfig`) at the top
level or in a ``tiered_kv`` table, ``config_file`` (a TOML file of them), ``model_id`` /
``revision`` (when ``--model-path`` is not what should name the blocks) and ``write_timeout``
(seconds a backup waits for its pages to reach the lower tiers: default 5 s; with a lookup
deadline per lower tier at most 8 s, inside the 10 s SGLang joins its storage threads for:
:mod:`tiered_kv.integrations.sglang_io`). ``TIERED_KV_*`` variables apply as everywhere. The
host tier here is only a staging area for write-behind (SGLang's host pool is the L2): by
default it holds 4 batches of 128 pages; 2 on an MLA rank that is not the storage writer (it
stores nothing, and reads into SGLang's host pool take no staging: the 2 only let a read load a
whole batch at once).

What SGLang gets (its contract, see ``../shared/connectors.md``): every page is a self-checking
block of the namespace :mod:`tiered_kv.integrations.sglang_pages` derives from the checkpoint
(``--model-path``, not the served name), the host pool (layout, geometry, dtype, TP shard; MLA
stored once), a local model's weight files and the server args that change the KV
(``--quantization``, ``--kv-cache-dtype``, …); ``batch_exists`` returns the leading run of this
rank's stored pages; reads stop at the first page that is missing or fails its checks (a counted
miss: SGLang cuts the prefix there); re-setting a stored page is success; a backup reports True
for a page once a lower tier holds it (:mod:`tiered_kv.integrations.sglang_io`); nothing raises
into SGLang's I/O threads (an exception there zeroes a whole prefetch): every failure is logged,
counted and answered as a miss. A failed ``clear`` raises (SGLang reports it failed). ``get_stats``
(every scheduler step with ``--enable-metrics``) does no I/O. Both interfaces work: v0
(``get``/``set`` of flat data pages) and the v1 zero-copy one (``batch_get_v1``/``batch_set_v1``
over host indices, selected by ``"interface_v1": 1``); both store the same bytes.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from storage_backends.log_throttle import LogThrottle
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import BackendUnavailable, ConfigError
from tiered_kv.integrations import sglang_pages
from tiered_kv.integrations.common import acquire_store, parse_settings, release_store
from tiered_kv.integrations.sglang_io import Staging, backup, read_pages, stored_run, write_timeout_of
from tiered_kv.integrations.sglang_pages import PageGeometry, geometry_of, page_key, page_namespace

try:  # SGLang installed: subclass its interface (its factory checks the class)
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
except ImportError:  # not installed: the adapter still imports (tests, tools)
    HiCacheStorage = object  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)

OUR_KEYS = frozenset(f.name for f in TieredKVConfig.__dataclass_fields__.values()) | {"config_file"}
ADAPTER_KEYS = frozenset({"model_id", "revision", "write_timeout", "tiered_kv"})
NOT_REGISTERED = "SGLang has not registered its host pool with the storage backend yet"
DEFAULT_STAGED_PAGES = 4 * 128  # host staging tier: 4 of SGLang's storage batches
READER_STAGED_PAGES = 2 * 128  # a rank that never writes: a read loads half the host tier at once
# per-call samples kept for get_stats: SGLang drains them only under --enable-metrics, so without
# it they would grow by one per prefetch/backup for the life of the server
METRIC_SAMPLES = 4096


def _answers(default: Callable[..., Any]):
    """Run the method; on any exception log it, count it and return ``default(*args)``."""
    def wrap(method):
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except Exception as exc:
                with self._metrics_lock:
                    self._failures += 1
                if self._complaints.warning("tiered-kv SGLang storage: %s failed (%s: %s); answered as "
                                            "a miss", method.__name__, type(exc).__name__, exc):
                    log.debug("the failure", exc_info=True)
                return default(*args, **kwargs)
        return guarded
    return wrap


def _keys_of(args: tuple, kwargs: dict) -> Sequence:
    return args[0] if args else kwargs.get("keys", ())


def _no_pages(*args, **kwargs) -> list[bool]:
    return [False] * len(_keys_of(args, kwargs))


def _no_tensors(*args, **kwargs) -> list[None]:
    return [None] * len(_keys_of(args, kwargs))


class TieredKVHiCacheStorage(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` over a :class:`~tiered_kv.store.TieredStore`."""

    def __init__(self, storage_config: Any, kwargs: Mapping[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        nested = extra.get("tiered_kv") or {}
        if not isinstance(nested, Mapping):
            raise ConfigError("SGLang extra config: 'tiered_kv' must be a table of tiered-kv settings")
        self._ours = {**{k: v for k, v in extra.items() if k in OUR_KEYS}, **nested}
        self.settings = parse_settings(self._ours, source="SGLang storage extra config")  # fail early
        server_args = sglang_pages.server_args_of(kwargs)
        # the checkpoint names the pages: SGLang's model_name is the served name, a mere label
        self.model_id = extra.get("model_id") or sglang_pages.checkpoint_of(server_args)
        revision = str(extra.get("revision") or self.settings.config.model_revision or "")
        # the server's quantization, KV dtype, config overrides, ... name the pages too
        self.revision = sglang_pages.page_revision(revision, server_args,
                                                   getattr(storage_config, "model_name", None))
        self.write_timeout = write_timeout_of(extra.get("write_timeout"), self.settings.config)
        self.writer = bool(getattr(storage_config, "is_storage_writer", True))
        self.mem_pool_host = None
        self.geometry: PageGeometry | None = None
        self.namespace = None
        self._store = None
        self._lock = threading.Lock()
        self._clearing: threading.Thread | None = None  # the last clear's thread
        self._staging = Staging()  # per-thread staging blocks for reads
        self._failures = 0  # calls answered as misses because they failed
        self._complaints = LogThrottle(log, 30.0)
        self._metrics_lock = threading.Lock()
        self._metrics: dict[str, list] = {"prefetch_pgs": [], "backup_pgs": [],
                                          "prefetch_bandwidth": [], "backup_bandwidth": []}

    # -- set-up ----------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang hands us its host KV pool: the pages' geometry names the namespace."""
        geometry = geometry_of(mem_pool_host, mla=bool(getattr(self.storage_config, "is_mla_model", False)))
        data = dict(self._ours)
        host = dict(data.get("host") or {})
        staged = DEFAULT_STAGED_PAGES if self.writer else READER_STAGED_PAGES
        host.setdefault("capacity", staged * geometry.page_bytes)
        host.setdefault("pinned", "no")  # a staging area for write-behind: never copied to a GPU
        data["host"] = host
        config = parse_settings(data, source="SGLang storage extra config").config
        namespace = page_namespace(geometry, self.storage_config, model_id=self.model_id,
                                   revision=self.revision, hash_algo=config.hash_algo)
        store = acquire_store(config, namespace)
        with self._lock:
            old, self._store = self._store, store
            self.mem_pool_host, self.geometry, self.namespace = mem_pool_host, geometry, namespace
        if old is not None:
            release_store(old)
        log.info("tiered-kv SGLang storage: %s pages of %d bytes (%s), tiers: %s", geometry.kind,
                 geometry.page_bytes, geometry.layout, ", ".join(["host"] + [t.name for t in store.tiers]))

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """The KV pool again is fine; extra pools (Mamba and SWA state, sparse indexers, drafts)
        are refused at attach time: tiered-kv stores KV pages only so far, and SGLang would
        otherwise call the per-pool (v2) interface from its threads."""
        if str(host_pool_name) == "kv":  # SGLang's PoolName.KV prints as its value
            return
        raise ConfigError(f"tiered-kv SGLang storage stores KV pages only; SGLang's {host_pool_name} "
                          "host pool (hybrid, sliding-window or sparse models) is not supported yet")

    def on_host_pools_registered(self) -> None:
        pass

    @property
    def store(self):
        store = self._store
        if store is None:
            raise ConfigError(NOT_REGISTERED)
        return store

    # -- existence ---------------------------------------------------------------------------------
    @_answers(lambda *a, **k: 0)
    def batch_exists(self, keys: Sequence[str], extra_info: Any = None) -> int:
        """How many leading pages of ``keys`` this rank has stored (SGLang takes the smallest
        answer of its ranks: only this rank's copies are asked for)."""
        return stored_run(self.store, self._keys(keys))

    @_answers(lambda *a, **k: False)
    def exists(self, key: str) -> bool:
        return stored_run(self.store, self._keys([key])) == 1

    # -- v0: flat data pages -------------------------------------------------------------------
    @_answers(lambda *a, **k: None)
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None):
        target = target_location if target_location is not None else self._new_page()
        return target if self._read([key], [target])[0] else None

    @_answers(_no_tensors)
    def batch_get(self, keys: Sequence[str], target_locations: Any = None, target_sizes: Any = None):
        targets = list(target_locations) if target_locations is not None else [self._new_page() for _ in keys]
        ok = self._read(keys, targets)
        return [t if good else None for t, good in zip(targets, ok)]

    @_answers(lambda *a, **k: False)
    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return all(self._write([key], [value]))

    @_answers(lambda *a, **k: False)
    def batch_set(self, keys: Sequence[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return all(self._write(keys, list(values)))

    # -- v1: host pool indices (zero-copy interface) ---------------------------------------------
    @_answers(_no_pages)
    def batch_get_v1(self, keys: Sequence[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Read ``keys`` into the host pool's pages starting at ``host_indices[i * page_size]``."""
        pool, starts = self.mem_pool_host, self._page_starts(keys, host_indices)
        pages = [pool.get_data_page(s, flat=False) for s in starts]
        return self._read(keys, pages)

    @_answers(_no_pages)
    def batch_set_v1(self, keys: Sequence[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        pool, starts = self.mem_pool_host, self._page_starts(keys, host_indices)
        return self._write(keys, [pool.get_data_page(s, flat=True) for s in starts])

    # -- the rest of the interface ---------------------------------------------------------------
    def clear(self) -> None:
        """Remove every page of this namespace from every tier (SGLang's ``clear_storage_backend``).
        A failure raises: SGLang's storage attachment logs it and answers False (a failure
        answered as None was logged "cleared successfully"). SGLang calls it on its scheduler
        thread: the work runs on a thread of its own, waited for at most twice ``write_timeout``
        (the flush, then the deletes); past that it raises and goes on in the background (a hung
        tier stalls it, not the scheduler), and a clear asked for meanwhile is refused."""
        with self._lock:
            if self._clearing is not None and self._clearing.is_alive():
                raise BackendUnavailable("tiered-kv SGLang storage: the clear asked for earlier is still "
                                         "running (a lower tier is not answering); nothing more started")
            outcome: list[Exception | None] = []
            self._clearing = threading.Thread(target=self._clear_now, args=(self.store, outcome),
                                              name="tiered-kv-sglang-clear", daemon=True)
        self._clearing.start()
        self._clearing.join(2 * self.write_timeout)
        if not outcome:
            raise BackendUnavailable(f"tiered-kv SGLang storage: the clear did not finish within "
                                     f"{2 * self.write_timeout:g} s (a lower tier is not answering); "
                                     f"it goes on in the background")
        if outcome[0] is not None:
            raise outcome[0]

    def _clear_now(self, store, outcome: list) -> None:
        from tiered_kv.admin.evict_copy import evict
        from tiered_kv.admin.opening import Tier

        try:
            if not store.flush(self.write_timeout):  # a write-behind left running would store pages again
                raise BackendUnavailable(f"tiered-kv SGLang storage: backups still being written after "
                                         f"{self.write_timeout:g} s; nothing cleared")
            for tier in store.tiers:
                evict(Tier(tier.name, tier.backend), namespace=self.namespace.digest())
            store.host.delete_many(list(store.host.scan()))
        except Exception as exc:  # (raised to the caller when it still waits; logged for when it does not)
            log.warning("tiered-kv SGLang storage: clear failed: %s", exc)
            outcome.append(exc)
            return
        log.info("tiered-kv SGLang storage: cleared")
        outcome.append(None)

    @_answers(lambda *a, **k: None)
    def get_stats(self):
        """SGLang's ``StorageMetrics`` of the calls since the last time it asked (pages per call,
        GB/s); None before the pool is registered. SGLang asks on its scheduler thread every step
        (``--enable-metrics``): nothing here touches a tier (the store's own metrics are served by
        ``metrics_port`` / ``metrics_log_interval``)."""
        with self._metrics_lock:
            drained = self._metrics
            self._metrics = {k: [] for k in drained}
        if self._store is None:
            return None
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return drained
        return StorageMetrics(**drained)

    def close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            release_store(store)

    # -- moving pages ----------------------------------------------------------------------------
    def _keys(self, keys: Sequence[str]) -> list[bytes]:
        namespace = self.namespace
        if namespace is None:
            raise ConfigError(NOT_REGISTERED)
        return [page_key(namespace, k) for k in keys]

    def _page_starts(self, keys: Sequence[str], host_indices: Any) -> list[int]:
        """The host index each page starts at. SGLang's indices are logical: with decode context
        parallelism a logical page spans ``page_size x dcp_size`` of them (the pool maps them)."""
        size = int(getattr(self.mem_pool_host, "logical_page_size", None) or self.geometry.page_size)
        if len(host_indices) < len(keys) * size:
            raise ValueError(f"{len(keys)} pages need {len(keys) * size} host indices, got {len(host_indices)}")
        return [int(host_indices[i * size]) for i in range(len(keys))]

    def _new_page(self):
        import torch

        return torch.zeros(self.geometry.page_elements, dtype=self.store.dtype)

    def _read(self, keys: Sequence[str], pages: Sequence[Any]) -> list[bool]:
        """Load the leading stored run of ``keys`` into ``pages`` (one page each, any layout)."""
        started = time.perf_counter()
        ok = read_pages(self.store, self._keys(keys), pages, self._staging)
        self._note("prefetch", sum(ok), started)
        return ok

    def _write(self, keys: Sequence[str], pages: Sequence[Any]) -> list[bool]:
        """Back ``pages`` (flat data pages) up under ``keys``: True where a lower tier holds them
        within ``write_timeout`` (:func:`~tiered_kv.integrations.sglang_io.backup`)."""
        if not keys:
            return []
        if not self.writer:  # an MLA rank that is not the writer: the writer stores the same bytes
            return [True] * len(keys)
        started = time.perf_counter()
        ok = backup(self.store, self._keys(keys), pages, self.write_timeout)
        self._note("backup", sum(ok), started)
        return ok

    def _note(self, what: str, pages: int, started: float) -> None:
        if not pages:
            return
        seconds = max(time.perf_counter() - started, 1e-9)
        with self._metrics_lock:
            if len(self._metrics[f"{what}_pgs"]) >= METRIC_SAMPLES:  # (nobody asked: see METRIC_SAMPLES)
                return
            self._metrics[f"{what}_pgs"].append(pages)
            self._metrics[f"{what}_bandwidth"].append(pages * self.geometry.page_bytes / seconds / 1e9)
