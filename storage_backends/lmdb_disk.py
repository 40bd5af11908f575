"""Disk tier: one LMDB environment with a meta table and LRU eviction to a byte capacity.

Named databases inside the environment:

- ``blocks``: key -> stored value (already encoded and compressed by the caller);
- ``meta``: key -> (stored size, last access ns, hits, created ns);
- ``lru``: big-endian last access ns || key -> empty, so a cursor from the start yields the
  least recently used entry;
- ``info``: ``used`` and ``entries`` totals, updated in the same write transaction as every
  put, delete and eviction, so they stay right with several processes on one directory.

Reopening the environment is the whole warm-up: usage, entry count and LRU order come back from
these tables without a scan. Reads record accesses in memory; they are applied in the next write
transaction (or on ``flush``/``close``), never with a write per read. A value that cannot fit is
refused (``False``), and ``lmdb.MapFullError`` never reaches the caller.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Iterator, Sequence

import lmdb

from storage_backends.base import Backend, BackendStats, Visitor
from storage_backends.registry import split_options
from tiered_kv.errors import ConfigError
from tiered_kv.units import format_size, parse_size

log = logging.getLogger(__name__)

META = struct.Struct("<QQIQ")  # size, last access ns, hits, created ns
U64 = struct.Struct("<Q")
BATCH_BYTES = 8 << 20  # values per write transaction: a few MiB amortise the commit
BATCH_ITEMS = 64
MAX_TOUCHES = 4096  # pending read accesses before they are applied eagerly


def _bool(value, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{name} must be true or false, got {value!r}")


def path_of(url: str) -> Path:
    """``lmdb:///abs/dir`` -> /abs/dir; ``lmdb://./rel`` and ``lmdb:rel`` -> rel."""
    base, _ = split_options(url)
    rest = base[len("lmdb:"):]
    if rest.startswith("//"):
        rest = rest[2:]
    if not rest:
        raise ConfigError(f"lmdb URL {url!r} names no directory")
    return Path(rest)


class LmdbBackend(Backend):
    name = "lmdb"

    def __init__(self, path: str | os.PathLike, *, capacity: int, sync: bool = False,
                 map_size: int | None = None, readahead: bool = True, url: str | None = None) -> None:
        super().__init__(url or f"lmdb://{Path(path).resolve()}")
        if capacity <= 0:
            raise ConfigError(f"lmdb capacity must be positive, got {capacity}")
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(f"lmdb path {self.path} exists and is not a directory")
        self.path.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self.map_size = map_size or max(2 * capacity, capacity + (1 << 30))
        try:
            self.env = lmdb.open(str(self.path), map_size=self.map_size, max_dbs=8, sync=sync,
                                 metasync=sync, readahead=readahead, max_readers=512, lock=True)
        except lmdb.Error as exc:
            raise ConfigError(f"cannot open LMDB store at {self.path}: {exc}") from None
        self.map_size = self.env.info()["map_size"]  # another process may have grown it
        self.blocks = self.env.open_db(b"blocks")
        self.meta = self.env.open_db(b"meta")
        self.lru = self.env.open_db(b"lru")
        self.info = self.env.open_db(b"info")
        self._lock = threading.Lock()
        self._touches: dict[bytes, tuple[int, int]] = {}  # key -> (last access ns, extra hits)
        self._pins: Counter = Counter()
        self._closed = False
        used, entries = self._totals()
        log.info("lmdb tier at %s: %d blocks, %s of %s used (map %s)", self.path, entries,
                 format_size(used), format_size(capacity), format_size(self.map_size))

    @classmethod
    def from_url(cls, url: str, **options) -> "LmdbBackend":
        _, query = split_options(url)
        query.update({k: v for k, v in options.items() if v is not None})
        capacity = parse_size(query.pop("capacity", 8 << 30), name="lmdb capacity")
        sync = _bool(query.pop("sync", False), "lmdb sync")
        readahead = _bool(query.pop("readahead", True), "lmdb readahead")
        map_size = query.pop("map_size", None)
        map_size = parse_size(map_size, name="lmdb map_size") if map_size is not None else None
        if query:
            raise ConfigError(f"unknown lmdb option {sorted(query)[0]!r}")
        return cls(path_of(url), capacity=capacity, sync=sync, map_size=map_size,
                   readahead=readahead, url=url)

    # -- reads -------------------------------------------------------------------------------
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(keys)

        def keep(i: int, value: memoryview) -> None:
            out[i] = bytes(value)

        self.visit_many(keys, keep)
        return out

    def visit_many(self, keys: Sequence[bytes], visitor: Visitor) -> list[bool]:
        self._check_open()
        found = [False] * len(keys)
        nbytes = 0
        now = time.time_ns()
        with self.env.begin(db=self.blocks, buffers=True) as txn:
            for i, key in enumerate(keys):
                value = txn.get(key)
                if value is None:
                    continue
                found[i] = True
                nbytes += len(value)
                visitor(i, memoryview(value))
        hits = [k for k, f in zip(keys, found) if f]
        if hits:
            self._touch(hits, now)
        self._count(gets=len(keys), hits=len(hits), bytes_out=nbytes)
        return found

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Asks the meta table (small, densely packed pages): asking the block table would
        fault in the first page of every large value, which is slow on a cold restart."""
        self._check_open()
        with self.env.begin(db=self.meta, buffers=True) as txn:
            return [txn.get(k) is not None for k in keys]

    def scan(self, prefix: bytes = b"") -> Iterator[bytes]:
        self._check_open()
        keys = []
        with self.env.begin(db=self.blocks) as txn:
            cursor = txn.cursor()
            if cursor.set_range(prefix):
                for key in cursor.iternext(keys=True, values=False):
                    if not key.startswith(prefix):
                        break
                    keys.append(key)
        return iter(keys)

    # -- writes ------------------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        self._check_open()
        stored: list[bool] = []
        batch: list[tuple[bytes, bytes]] = []
        size = 0
        for key, value in items:
            batch.append((key, value))
            size += len(value)
            if size >= BATCH_BYTES or len(batch) >= BATCH_ITEMS:
                stored.extend(self._put_batch(batch))
                batch, size = [], 0
        if batch:
            stored.extend(self._put_batch(batch))
        return stored

    def _put_batch(self, batch: list[tuple[bytes, bytes]]) -> list[bool]:
        for attempt in range(3):
            try:
                return self._write(lambda txn: [self._put_one(txn, k, v) for k, v in batch])
            except lmdb.MapFullError:
                # the map holds more than the capacity (page overhead, free pages not yet
                # reusable by long readers): grow it and try again
                self._grow_map()
        log.warning("lmdb tier: map still full after growing; %d values refused", len(batch))
        self._count(put_rejected=len(batch))
        return [False] * len(batch)

    def _put_one(self, txn, key: bytes, value: bytes) -> bool:
        if not key or len(key) > 511:
            raise ValueError("lmdb keys must be 1..511 bytes")
        size = len(value)
        if size > self.capacity:
            self._count(put_rejected=1)
            return False
        used, entries = self._read_totals(txn)
        old = txn.get(key, db=self.meta)
        if old is not None:  # overwrite: the old entry goes first
            old_size, old_atime, _, _ = META.unpack(old)
            txn.delete(_lru_key(old_atime, key), db=self.lru)
            txn.delete(key, db=self.meta)
            txn.delete(key, db=self.blocks)
            used -= old_size
            entries -= 1
        used, entries = self._evict(txn, used, entries, size, protect=key)
        if used + size > self.capacity:
            self._write_totals(txn, used, entries)
            self._count(put_rejected=1)
            return False
        now = time.time_ns()
        txn.put(key, value, db=self.blocks)
        txn.put(key, META.pack(size, now, 0, now), db=self.meta)
        txn.put(_lru_key(now, key), b"", db=self.lru)
        self._write_totals(txn, used + size, entries + 1)
        self._count(puts=1, bytes_in=size)
        return True

    def _evict(self, txn, used: int, entries: int, incoming: int, protect: bytes) -> tuple[int, int]:
        """Delete least recently used, unpinned entries until ``incoming`` bytes fit."""
        if used + incoming <= self.capacity:
            return used, entries
        with self._lock:
            pinned = {k for k, n in self._pins.items() if n > 0}
        cursor = txn.cursor(db=self.lru)
        victims = []
        for lru_key in cursor.iternext(keys=True, values=False):
            if used + incoming <= self.capacity:
                break
            key = bytes(lru_key[8:])
            if key in pinned or key == protect:
                continue
            meta = txn.get(key, db=self.meta)
            size = META.unpack(meta)[0] if meta is not None else 0
            victims.append((bytes(lru_key), key))
            used -= size
            entries -= 1
        for lru_key, key in victims:
            txn.delete(lru_key, db=self.lru)
            txn.delete(key, db=self.meta)
            txn.delete(key, db=self.blocks)
        if victims:
            self._count(evictions=len(victims))
        return used, entries

    def delete_many(self, keys: Sequence[bytes]) -> int:
        self._check_open()

        def delete(txn) -> int:
            used, entries = self._read_totals(txn)
            n = 0
            for key in keys:
                meta = txn.get(key, db=self.meta)
                present = txn.delete(key, db=self.blocks)
                if meta is not None:
                    size, atime, _, _ = META.unpack(meta)
                    txn.delete(key, db=self.meta)
                    txn.delete(_lru_key(atime, key), db=self.lru)
                    used -= size
                    entries -= 1
                n += int(present)
            self._write_totals(txn, used, entries)
            return n

        n = self._write(delete)
        self._count(deletes=n)
        return n

    # -- accesses, pins, durability ----------------------------------------------------------
    def _touch(self, keys: list[bytes], now: int) -> None:
        with self._lock:
            for key in keys:
                _, hits = self._touches.get(key, (0, 0))
                self._touches[key] = (now, hits + 1)
            eager = len(self._touches) >= MAX_TOUCHES
        if eager:
            self._write(lambda txn: None)

    def _apply_touches(self, txn) -> None:
        with self._lock:
            touches, self._touches = self._touches, {}
        for key, (atime, hits) in touches.items():
            meta = txn.get(key, db=self.meta)
            if meta is None:
                continue  # evicted or deleted meanwhile (maybe by another process)
            size, old_atime, old_hits, created = META.unpack(meta)
            if atime <= old_atime:
                atime = old_atime
            txn.delete(_lru_key(old_atime, key), db=self.lru)
            txn.put(_lru_key(atime, key), b"", db=self.lru)
            txn.put(key, META.pack(size, atime, old_hits + hits, created), db=self.meta)

    def _write(self, body):
        """Run ``body(txn)`` in one write transaction, after applying buffered accesses."""
        with self.env.begin(write=True) as txn:
            self._apply_touches(txn)
            return body(txn)

    def pin_many(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._pins.update(keys)

    def unpin_many(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._pins.subtract(keys)
            for key in keys:
                if self._pins[key] <= 0:
                    del self._pins[key]

    def flush(self) -> None:
        self._check_open()
        self._write(lambda txn: None)
        self.env.sync(True)

    def _grow_map(self) -> None:
        new = int(self.env.info()["map_size"] * 1.5)
        log.info("lmdb tier: growing the map to %s", format_size(new))
        self.env.set_mapsize(new)
        self.map_size = new

    # -- totals, stats, check ----------------------------------------------------------------
    def _read_totals(self, txn) -> tuple[int, int]:
        used = txn.get(b"used", db=self.info)
        entries = txn.get(b"entries", db=self.info)
        return (U64.unpack(used)[0] if used else 0, U64.unpack(entries)[0] if entries else 0)

    def _write_totals(self, txn, used: int, entries: int) -> None:
        txn.put(b"used", U64.pack(max(0, used)), db=self.info)
        txn.put(b"entries", U64.pack(max(0, entries)), db=self.info)

    def _totals(self) -> tuple[int, int]:
        with self.env.begin() as txn:
            return self._read_totals(txn)

    def stats(self) -> BackendStats:
        self._check_open()
        used, entries = self._totals()
        data = self.path / "data.mdb"
        with self._lock:
            pending, pinned = len(self._touches), len(self._pins)
        return self._snapshot(entries=entries, used_bytes=used, capacity_bytes=self.capacity, extra={
            "map_size": self.map_size, "page_size": self.env.stat()["psize"],
            "file_bytes": data.stat().st_size if data.exists() else 0,
            "pending_touches": pending, "pinned": pinned})

    def lru_order(self) -> list[bytes]:
        """Keys from least to most recently used (after applying pending accesses)."""
        self._write(lambda txn: None)
        with self.env.begin(db=self.lru) as txn:
            return [bytes(k[8:]) for k in txn.cursor().iternext(keys=True, values=False)]

    def entry_meta(self, key: bytes) -> dict | None:
        """Size, last access, hits and creation time of ``key`` (None when absent)."""
        with self.env.begin(db=self.meta) as txn:
            meta = txn.get(key)
        if meta is None:
            return None
        size, atime, hits, created = META.unpack(meta)
        return {"size": size, "last_access_ns": atime, "hits": hits, "created_ns": created}

    def check(self, fix: bool = False) -> list[str]:
        """Problems between the block, meta, LRU and info tables; repaired only with ``fix``."""
        self._check_open()
        problems: list[str] = []

        def run(txn) -> None:
            blocks = {bytes(k): len(v) for k, v in txn.cursor(db=self.blocks)}
            metas = {bytes(k): META.unpack(v) for k, v in txn.cursor(db=self.meta)}
            lrus = {bytes(k) for k in txn.cursor(db=self.lru).iternext(keys=True, values=False)}
            now = time.time_ns()
            for key, size in blocks.items():
                meta = metas.get(key)
                if meta is None:
                    problems.append(f"block without meta: {key.hex()}")
                    if fix:
                        txn.put(key, META.pack(size, now, 0, now), db=self.meta)
                        txn.put(_lru_key(now, key), b"", db=self.lru)
                        metas[key] = (size, now, 0, now)
                        lrus.add(_lru_key(now, key))
                elif meta[0] != size:
                    problems.append(f"meta size {meta[0]} != stored size {size}: {key.hex()}")
                    if fix:
                        txn.put(key, META.pack(size, *meta[1:]), db=self.meta)
                        metas[key] = (size, *meta[1:])
            for key, meta in list(metas.items()):
                if key not in blocks:
                    problems.append(f"meta without block: {key.hex()}")
                    if fix:
                        txn.delete(key, db=self.meta)
                        txn.delete(_lru_key(meta[1], key), db=self.lru)
                        lrus.discard(_lru_key(meta[1], key))
                        del metas[key]
                elif _lru_key(meta[1], key) not in lrus:
                    problems.append(f"meta without LRU entry: {key.hex()}")
                    if fix:
                        txn.put(_lru_key(meta[1], key), b"", db=self.lru)
                        lrus.add(_lru_key(meta[1], key))
            wanted = {_lru_key(m[1], k) for k, m in metas.items()}
            for lru_key in lrus - wanted:
                problems.append(f"stale LRU entry: {lru_key[8:].hex()}")
                if fix:
                    txn.delete(lru_key, db=self.lru)
            used, entries = self._read_totals(txn)
            true_used, true_entries = sum(blocks.values()), len(blocks)  # the block table is the truth
            if (used, entries) != (true_used, true_entries):
                problems.append(f"info totals {used} bytes / {entries} entries, tables hold "
                                f"{true_used} / {true_entries}")
                if fix:
                    self._write_totals(txn, true_used, true_entries)

        if fix:
            self._write(run)
        else:
            with self.env.begin() as txn:
                run(txn)
        return problems

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            with self.env.begin(write=True) as txn:
                self._apply_touches(txn)
        finally:
            self.env.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("lmdb backend is closed")


def _lru_key(atime_ns: int, key: bytes) -> bytes:
    return struct.pack(">Q", atime_ns) + key
