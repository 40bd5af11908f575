"""Disk tier: one LMDB environment with a meta table and LRU eviction to a byte capacity, and
byte quotas per tenant.

Named databases inside the environment (a directory; formats in :mod:`storage_backends.lmdb_tables`):
``blocks`` (key -> stored value, already encoded and compressed by the caller) for values under
``segment_min`` bytes; larger values are appended to segment files beside it and ``places`` says
where they lie (:mod:`storage_backends.lmdb_segments`: each is written once, in parallel, outside
LMDB's single writer, before the transaction that records it); ``meta`` (size, times, hits and
tenant of each key), ``lru`` and ``tenant_lru`` (keys in access order, overall and per tenant),
``tenants`` and ``info`` (used bytes and entries per tenant and overall, and the format), all
updated in the same write transaction as every put, delete and eviction: right with several processes.

Reopening is the whole warm-up: usage (per tenant too), entry count and LRU order come back from
these tables without a scan. ``tenant_quota`` / ``tenant_quotas`` bound each tenant's bytes, with a
capacity or without one (a tool's open; they used to be ignored there): a put over its quota evicts
the tenant's own least recently used entries, or is refused (:mod:`storage_backends.eviction`).
Reads record accesses in memory, applied in the next write transaction (or on ``flush``/``close``,
or when many are pending), never with a write per read. A value that cannot fit is refused
(``False``); ``lmdb.MapFullError`` never reaches the caller: the map grows (it is sparse) or more
is evicted. Remapping (ours, or adopting a map another process grew) waits for every transaction
of this process to end: zero-copy buffers never outlive their mapping."""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import quote

from storage_backends.base import Backend, BackendStats, TenantTotal, Visitor
from storage_backends.eviction import Eviction
from storage_backends.eviction_lru import LRU
from storage_backends.lmdb_check import check_tables
from storage_backends.lmdb_compaction import Compactor
from storage_backends.lmdb_entries import evict_beyond
from storage_backends.lmdb_environment import LmdbEnvironment, NoSpace
from storage_backends.lmdb_options import lmdb_settings, store_directory, url_options
from storage_backends.lmdb_reads import LmdbReads
from storage_backends.lmdb_segment_check import check_segments
from storage_backends.lmdb_segments import SegmentFiles
from storage_backends.lmdb_tables import (
    Write,
    as_key,
    fits,
    indexed,
    read_totals,
    tenant_totals,
    unpack_meta,
)
from storage_backends.lmdb_values import SegmentValues
from storage_backends.lmdb_warmup import warm_index
from storage_backends.lmdb_writes import LmdbWrites
from storage_backends.options import directory_of, existing_directory, warn_if_relative
from tiered_kv.errors import BackendClosed, BackendUnavailable, ConfigError, InvalidKey
from tiered_kv.units import format_size

__all__ = ["BackendClosed", "InvalidKey", "LmdbBackend", "path_of"]

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = 8 << 30  # a URL's capacity when it gives none (the engine's [[tiers]] without one)


def path_of(url: str) -> Path:
    """``lmdb:///abs/dir`` -> /abs/dir; ``lmdb://./rel``, ``lmdb:rel`` -> rel; ``~`` expands."""
    return directory_of(url, "lmdb")


class LmdbBackend(Backend):
    """The disk tier's Backend interface over an :class:`LmdbEnvironment`, plus this process's
    pins (leases) and the capacity they are evicted to. ``capacity=None`` (a tool's open) evicts only
    for tenant quotas: a put that does not fit is refused; the map is the environment's own."""

    name = "lmdb"
    store_signature = "LMDB data.mdb"
    takes_gathered = True  # a segment value is written from its parts (LMDB's pages get them joined)

    def __init__(self, path: str | os.PathLike, *, capacity: int | str | None, url: str | None = None,
                 read_only: bool = False, **options) -> None:
        """``options``: those of :func:`~storage_backends.lmdb_options.lmdb_settings`, read there."""
        self.path = Path(path)
        super().__init__(url or f"lmdb://{self.path.resolve()}")
        warn_if_relative(url, "lmdb", self.path)
        settings = lmdb_settings(capacity, **options)
        self.capacity, self.quotas, self.sync = settings.capacity, settings.quotas, settings.sync
        self.tenant_quota = self.quotas.default
        self._eviction = Eviction(LRU, self.capacity, self.quotas)  # (quotas hold with no capacity too)
        # (damaged_meta: lmdb_damage; sync_failed_entries: entries withdrawn, their fsync failed)
        self._counters.extra.update(quota_evictions=0, damaged_meta=0, sync_failed_entries=0)
        self.record_access, self.batch_bytes = settings.record_access, settings.batch_bytes
        wanted, per_file = settings.map_size, settings.segment_bytes
        store_directory(self.path)
        # writemap: puts into reused pages ~1.5x faster, but without sync a machine crash may
        # corrupt the environment (not only lose the last commits); every process must agree
        if settings.writemap and not self.sync:
            log.warning("lmdb tier at %s: writemap without sync: a machine crash may corrupt it",
                        self.path)
        options = dict(map_size=wanted, max_dbs=16, sync=self.sync, metasync=self.sync,
                       readahead=settings.readahead, writemap=settings.writemap,
                       max_readers=settings.max_readers, lock=True)
        self._lock = threading.Lock()  # pins
        self._pins: Counter = Counter()
        self._db = LmdbEnvironment(self.path, options, max_map=self.capacity and max(wanted, 4 * self.capacity + (1 << 30)),
                                   batch_bytes=self.batch_bytes, count=self._count,
                                   evict=self._evict_beyond_capacity, record_access=self.record_access,
                                   read_only=read_only)
        self._db.on_changes = self._tell_in_order  # committed puts, evictions and deletes
        self.values = SegmentValues(self._db, SegmentFiles(self.path, per_file, settings.writeback, settings.direct_io),
                                    settings.segment_min, self.sync)
        self._reads = LmdbReads(self._db, self.values, self._count)
        bound = self.capacity or self._db.map_size // 2  # (a tool's open: the map's usual capacity)
        self.compactor = Compactor(self._db, self.values, dead_limit=max(bound // 4, 2 * per_file))
        self._writes = LmdbWrites(self._db, self.values, self._eviction, self._pinned, self._count, self.compactor)
        if self.record_access:  # a writer: seal what dead processes left (tools change nothing)
            self.values.recover()
        used, entries = self._totals()
        self.warmup = None
        if self.record_access and entries:  # a restart: read the index into the page cache
            self.warmup = warm_index(self._db.txn, self._db.tables.meta, lambda: self._db.closed,
                                     f"lmdb tier at {self.path}")
        log.info("lmdb tier at %s: %d blocks, %s of %s used (map %s, file %s, %s)", self.path,
                 entries, format_size(used), format_size(self.capacity) if self.capacity else "no capacity",
                 format_size(self._db.map_size), format_size(self._db.file_bytes()[0]),
                 "sync" if self.sync else "no-sync")
        if self.capacity is not None and used > self.capacity and self.record_access:
            log.warning("lmdb tier at %s holds %s, over its capacity %s: the next puts evict",
                        self.path, format_size(used), format_size(self.capacity))

    @classmethod
    def from_url(cls, url: str, *, read_only: bool = False, **options) -> LmdbBackend:
        query = url_options(url, options)
        query.setdefault("capacity", DEFAULT_CAPACITY)
        return cls(path_of(url), url=url, read_only=read_only, **query)

    @classmethod
    def store_url_at(cls, path: Path) -> str | None:
        return f"lmdb://{quote(str(path.resolve()))}" if (path / "data.mdb").is_file() else None

    @classmethod
    def store_files(cls, path: Path) -> list[Path]:
        """The environment's files and its segment files (not ``reserve.space``: room held, no data)."""
        found = [path / name for name in ("data.mdb", "lock.mdb") if (path / name).is_file()]
        return found + sorted(SegmentFiles(path, 1 << 20).files().values())

    @classmethod
    def open_read_only(cls, url: str, *, options: dict | None = None, timeout: float = 5.0) -> LmdbBackend:
        """The existing environment at ``url`` with ``options`` (the engine's, over the query); reads
        are not recorded (``record_access=False``), and opening writes nothing (an older format stays
        as it is until a write). The capacity is read (refused in the medium's words) and kept as
        ``told_capacity``, not evicted to: its puts evict only for the tenant quotas, or are refused."""
        path = existing_directory(path_of(url))
        if cls.store_url_at(path) is None:
            raise ConfigError(f"{path} is not an LMDB store (no data.mdb)")
        query = url_options(url, {**(options or {}), "record_access": False})
        told = lmdb_settings(query.pop("capacity", None)).capacity  # (before anything is opened)
        backend = cls(path, url=url, read_only=True, capacity=None, **query)
        backend.told_capacity = told
        return backend

    @classmethod
    def create_for_tool(cls, url: str, *, room: int = 0) -> LmdbBackend:
        """A new store at ``url`` for a tool to fill: only the capacity the URL gives (none: it never
        evicts, as a tool's open of an existing store), a map with room for ``room`` bytes besides."""
        query = url_options(url, {"record_access": False})
        query.setdefault("map_size", room + (1 << 30))
        return cls(path_of(url), url=url, capacity=query.pop("capacity", None), **query)

    # -- the environment's handles (maintenance and tests) -----------------------------------
    @property
    def env(self):
        """The ``lmdb.Environment``."""
        return self._db.env

    blocks = property(lambda self: self._db.tables.blocks)
    meta = property(lambda self: self._db.tables.meta)
    lru = property(lambda self: self._db.tables.lru)

    # -- reads -------------------------------------------------------------------------------
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return self._get_by_visiting(keys)

    def visit_many(self, keys: Sequence[bytes], visitor: Visitor) -> list[bool]:
        return self._reads.visit_many(keys, visitor)

    def visit_ranges(self, keys: Sequence[bytes], visitor) -> list[bool]:
        return self._reads.visit_ranges(keys, visitor)

    def visit_split(self, keys: Sequence[bytes], outs: Sequence[object], visitor) -> list[bool]:
        return self._reads.visit_split(keys, outs, visitor)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Asks the meta table (small, dense pages: the block table would fault in the first
        page of every large value on a cold restart). No side effects."""
        keys = [as_key(k) for k in keys]
        with self._db.guard("contains"), self._db.txn() as txn:
            return [fits(k) and txn.get(k, db=self.meta) is not None for k in keys]

    def scan(self, prefix: bytes = b"") -> Iterator[bytes]:
        prefix = bytes(prefix)
        keys: list[bytes] = []
        with self._db.guard("scan"), self._db.txn() as txn:
            for db in (self.blocks, self._db.tables.places):
                cursor = txn.cursor(db=db)
                if cursor.set_range(prefix):
                    for key in cursor.iternext(keys=True, values=False):
                        if not key[: len(prefix)] == prefix:
                            break
                        keys.append(bytes(key))
        return iter(keys)

    # -- writes ------------------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[bytes, bytes]], tenant: bytes = b"") -> list[bool]:
        return self._writes.put_many(items, tenant)

    def delete_many(self, keys: Sequence[bytes]) -> int:
        return self._writes.delete_many(keys)

    # -- pins, durability --------------------------------------------------------------------
    def pin_many(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._pins.update(map(as_key, keys))

    def unpin_many(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in map(as_key, keys):
                self._pins[key] -= 1
                if self._pins[key] <= 0:
                    del self._pins[key]

    def _pinned(self) -> set[bytes]:
        with self._lock:
            return set(self._pins)

    def _evict_beyond_capacity(self, w: Write, nbytes: int) -> int:
        """Room for ``nbytes`` more than the capacity allows (the map is full, cannot grow); none
        without a capacity (a tool's open: the put is refused)."""
        return 0 if self.capacity is None else evict_beyond(self._db.tables, w, nbytes, self._eviction, self._pinned)

    def flush(self) -> None:
        """Apply buffered accesses and make every committed put durable (fsync); the entries of a
        segment whose fsync failed are withdrawn (the flush that found the failure raises)."""
        with self._db.guard("flush"):
            try:
                self.values.flush()
            except OSError as exc:
                raise BackendUnavailable(f"lmdb store at {self.path}: {exc}") from exc
        self._db.sync()

    def close(self) -> None:
        """Seal, fsync what this process wrote (segment values, then the index naming them) and close:
        what was stored is durable once it returns. Idempotent; waits for running calls."""
        if not self._db.closed and not self._db.gate.held():
            self.values.seal_own()
        if self._db.close(before=self.values.flush_at_close, after=self.values.files.close):
            log.info("lmdb tier at %s closed", self.path)

    # -- totals, stats, check ----------------------------------------------------------------
    def _totals(self) -> tuple[int, int]:
        with self._db.txn() as txn:
            return read_totals(self._db.tables, txn)

    def tenant_totals(self) -> dict[bytes, TenantTotal]:
        """Per tenant: bytes and entries, from the ``tenants`` table (every process's puts)."""
        with self._db.guard("tenants"), self._db.txn() as txn:
            return {tenant: TenantTotal(*t) for tenant, t in tenant_totals(self._db.tables, txn).items()}

    def figures(self) -> BackendStats:
        """Entries, used bytes and capacity from the ``info`` table: one read, nothing per entry
        or segment file (what a Prometheus scrape reads; :meth:`stats` adds the files' figures)."""
        with self._db.guard("figures"):
            used, entries = self._totals()
        return self._snapshot(entries=entries, used_bytes=used, capacity_bytes=self.capacity)

    def stats(self) -> BackendStats:
        """:meth:`figures`, the map's, the data file's and the segments' (lists and stats the files: tools)."""
        stats = self.figures()
        with self._db.guard("stats"):  # (transactions outside the shared gate: one may adopt a grown map)
            dead = self.compactor.dead_bytes()[1]
            with self._db.shared():
                info, page = self.env.info(), self.env.stat()["psize"]
        size, allocated = self._db.file_bytes()
        segments = {s: self.values.files.file_size(s) or 0 for s in self.values.files.files()}
        with self._lock:
            pinned = len(self._pins)
        stats.extra.update({"map_size": info["map_size"], "page_size": page, "file_bytes": size,
                            "file_allocated_bytes": allocated, "readers": info["num_readers"],
                            "last_txnid": info["last_txnid"], "pending_touches": len(self._db.accesses), "pinned": pinned,
                            "segment_files": len(segments), "segment_bytes": sum(segments.values()), "segment_dead_bytes": dead})
        return stats

    def compact(self) -> int:
        """Compact the sparsest sealed segment if dead bytes exceed the limit; values moved."""
        with self._db.guard("compact"):
            return self.compactor.maybe_compact(force=True)

    def lru_order(self) -> list[bytes]:
        """Keys from least to most recently used (after applying pending accesses)."""
        self._db.apply_pending()
        with self._db.txn() as txn:
            return [indexed(stamp, value) for stamp, value in txn.cursor(db=self.lru)]

    def entry_meta(self, key: bytes) -> dict | None:
        """Size, last access, hits, creation time and tenant of ``key`` (None when absent; an
        unreadable meta record: DamagedRecord)."""
        with self._db.txn() as txn:
            record = txn.get(as_key(key), db=self.meta)
            if record is None:
                return None
            meta = unpack_meta(record, key)
        return {"size": meta.size, "last_access_ns": meta.atime, "hits": meta.hits,
                "created_ns": meta.created, "tenant": meta.tenant}

    def check(self, fix: bool = False) -> list[str]:
        """Problems between the block, meta, both LRU, tenants and info tables (the block table
        is the truth); repaired only with ``fix``. Reads every value's pages: a maintenance call."""
        self._db.apply_pending()

        def run(txn, w: Write | None) -> list[str]:
            problems, placed = check_segments(self._db.tables, txn, w, self.values.files, self._db.txn)
            return problems + check_tables(self._db.tables, txn, w, placed)

        if not fix:
            with self._db.guard("check"), self._db.txn() as txn:
                return run(txn, None)
        with self._db.guard("check"):
            try:
                return self._db.write(lambda w: run(w.txn, w))
            except NoSpace as exc:  # (the repairs need room the disk has not got now)
                raise BackendUnavailable(f"lmdb store at {self.path}: no room to repair: {exc}") from None

