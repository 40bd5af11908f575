"""Entry operations of the LMDB tier inside one write transaction: put (after what
:mod:`storage_backends.eviction` decides must go), remove, evict beyond the capacity, and apply
buffered read accesses. ``tables`` is a :class:`storage_backends.lmdb_tables.Tables`. A meta
record that cannot be read never raises here (:mod:`storage_backends.lmdb_damage`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from storage_backends.eviction import Eviction, Victim
from storage_backends.lmdb_damage import damaged_victim, drop_damaged, read_meta
from storage_backends.lmdb_places import keys_in, place_value, unplace
from storage_backends.lmdb_segments import Place, segment_key
from storage_backends.lmdb_tables import (
    Meta,
    Tables,
    Write,
    atime_of,
    indexed,
    lru_value,
    stamp_of,
    tenant_prefix,
    tenant_stamp,
)

Pinned = Callable[[], set[bytes]]  # this process's leased keys, now


class TableIndex:
    """The :class:`~storage_backends.eviction.EvictionIndex` of one write transaction: the
    ``lru`` and ``tenant_lru`` tables (entries left there by damage are skipped, and dropped by
    :meth:`drop_stale`; an entry whose meta record is damaged may go, for its stored bytes), the
    pins of this process and the totals of ``w``."""

    def __init__(self, tables: Tables, w: Write, pinned: Pinned) -> None:
        self.tables, self.w, self._pinned, self._pins = tables, w, pinned, None
        self._stale: list[tuple[object, bytes]] = []  # (table, index key)

    def oldest(self, tenant: bytes | None = None) -> Iterator[Victim]:
        db, prefix = (self.tables.lru, b"") if tenant is None else (self.tables.tenant_lru, tenant_prefix(tenant))
        cursor = self.w.txn.cursor(db=db)
        if not cursor.set_range(prefix):
            return
        for stamp, value in cursor:
            if stamp[: len(prefix)] != prefix:
                return
            key = indexed(stamp, value, len(prefix))
            size = self._size_at(key, atime_of(stamp, len(prefix)), tenant)
            if size is None:
                self._stale.append((db, bytes(stamp)))  # not the key's real position
                continue
            yield key, size

    def _size_at(self, key: bytes, atime: int, tenant: bytes | None) -> int | None:
        """The bytes ``key`` holds when an index entry at ``atime`` (of ``tenant``'s) is its
        real position; None when that entry is stale."""
        record = self.w.txn.get(key, db=self.tables.meta)
        if record is None:
            return None
        meta = read_meta(self.w, key, record)
        if meta is None:  # damaged: it may go, for the bytes it holds
            return damaged_victim(self.tables, self.w, key, record, atime)
        if meta.atime != atime or (tenant is not None and meta.tenant != tenant):
            return None
        return meta.size

    def pinned(self, key: bytes) -> bool:
        if self._pins is None:
            self._pins = self._pinned()
        return key in self._pins

    def used(self, tenant: bytes | None = None) -> int:
        return self.w.used if tenant is None else self.w.tenant_used(tenant)

    def drop_stale(self) -> None:
        for db, stamp in self._stale:
            self.w.txn.delete(stamp, db=db)
        self._stale = []


def put_entry(tables: Tables, w: Write, key: bytes, value, size: int, tenant: bytes,
              eviction: Eviction, pinned: Pinned) -> bool:
    """Store ``value`` (bytes, or the :class:`Place` of bytes written to a segment) under
    ``key`` for ``tenant`` after evicting what ``eviction`` plans; False (counted as rejected)
    when it cannot be stored. An overwrite refused for want of room has lost the key's old
    value (the listener hears it removed), as on the file medium."""
    if not eviction.fits(tenant, size):
        w.counts["put_rejected"] += 1
        return False
    replaced = remove_entry(tables, w, key)  # an overwrite replaces the old entry
    index = TableIndex(tables, w, pinned)
    plan = eviction.plan(index, tenant, size)
    index.drop_stale()
    if plan is None:  # the rest is pinned (or the tenant's own entries are)
        w.counts["put_rejected"] += 1
        if replaced:
            w.changes.append(("removed", key))
        return False
    for victim, _ in plan.victims:
        remove_entry(tables, w, victim)
        w.changes.append(("removed", victim))
    w.counts["evictions"] += len(plan.victims)
    w.counts["quota_evictions"] += len(plan.quota)
    now = time.time_ns()
    if isinstance(value, Place):
        place_value(tables, w, key, value)
    else:
        w.txn.put(key, value, db=tables.blocks)
    w.txn.put(key, Meta(size, now, 0, now, tenant).pack(), db=tables.meta)
    index_entry(tables, w.txn, key, now, tenant)
    w.add(tenant, size, 1)
    w.changes.append(("stored", key))
    w.counts["puts"] += 1
    w.counts["bytes_in"] += size
    return True


def index_entry(tables: Tables, txn, key: bytes, atime: int, tenant: bytes) -> None:
    """Put ``key`` at ``atime`` in the ``lru`` and ``tenant_lru`` tables."""
    txn.put(stamp_of(atime, key), lru_value(key), db=tables.lru)
    txn.put(tenant_stamp(tenant, atime, key), lru_value(key, tenant_prefix(tenant)), db=tables.tenant_lru)


def unindex_entry(tables: Tables, txn, key: bytes, atime: int, tenant: bytes) -> None:
    txn.delete(stamp_of(atime, key), db=tables.lru)
    txn.delete(tenant_stamp(tenant, atime, key), db=tables.tenant_lru)


def remove_entry(tables: Tables, w: Write, key: bytes) -> bool:
    """Delete ``key`` from every table (a damaged meta record too); whether it was there."""
    record = w.txn.get(key, db=tables.meta)
    meta = read_meta(w, key, record) if record is not None else None  # before any write invalidates it
    if meta is not None:
        unindex_entry(tables, w.txn, key, meta.atime, meta.tenant)
        w.txn.delete(key, db=tables.meta)
        w.add(meta.tenant, -meta.size, -1)
    elif record is not None:
        drop_damaged(tables, w, key, record)
    placed = unplace(tables, w, key)
    return w.txn.delete(key, db=tables.blocks) or placed or record is not None


def delete_entry(tables: Tables, w: Write, key: bytes) -> bool:
    """Delete ``key`` on request (a change the listener hears of); whether it was there."""
    if not remove_entry(tables, w, key):
        return False
    w.changes.append(("removed", key))
    return True


def withdraw_segments(tables: Tables, w: Write, segments) -> dict[int, int]:
    """Delete every entry whose value lies in one of ``segments`` (an fsync of them failed:
    their bytes may never reach the disk), counted as ``sync_failed_entries``; entries
    withdrawn per segment (those that held any)."""
    withdrawn = {}
    for segment in segments:
        keys = list(keys_in(tables, w.txn, segment))
        n = sum(delete_entry(tables, w, key) for key in keys)
        for key in keys:  # (an entry left by damage, whose place is elsewhere, goes too)
            w.txn.delete(segment_key(segment) + key, db=tables.segment_keys)
        if n:
            withdrawn[segment] = n
            w.counts["sync_failed_entries"] += n
    return withdrawn


def evict_beyond(tables: Tables, w: Write, nbytes: int, eviction: Eviction, pinned: Pinned) -> int:
    """Evict until ``nbytes`` more than the capacity would fit (or nothing more may go)."""
    return _evict(tables, w, pinned, lambda index: eviction.beyond_capacity(index, nbytes))


def evict_oldest(tables: Tables, w: Write, nbytes: int, eviction: Eviction, pinned: Pinned) -> int:
    """Evict the first entries to go (the policy's order, pins kept) that hold ``nbytes``, or
    all there are, whatever the capacity: a disk that filled before the capacity was reached."""
    def victims(index: TableIndex) -> list[Victim]:
        chosen, freed = [], 0
        for victim in eviction.policy.candidates(index):
            if freed >= nbytes:
                break
            chosen.append(victim)
            freed += victim[1]
        return chosen
    return _evict(tables, w, pinned, victims)


def _evict(tables: Tables, w: Write, pinned: Pinned, choose: Callable[[TableIndex], list[Victim]]) -> int:
    index = TableIndex(tables, w, pinned)
    victims = choose(index)
    index.drop_stale()
    for key, _ in victims:
        remove_entry(tables, w, key)
        w.changes.append(("removed", key))
    w.counts["evictions"] += len(victims)
    return len(victims)


def apply_accesses(tables: Tables, w: Write, touches: dict[bytes, tuple[int, int]]) -> None:
    """Record buffered reads (key -> (last access ns, hits)) in the meta and LRU tables (not
    those of an entry whose meta record is damaged: counted, passed over)."""
    txn = w.txn
    for key, (atime, hits) in touches.items():
        record = txn.get(key, db=tables.meta)
        if record is None:
            continue  # evicted or deleted meanwhile (maybe by another process)
        meta = read_meta(w, key, record)
        if meta is None:
            continue
        if atime > meta.atime:
            unindex_entry(tables, txn, key, meta.atime, meta.tenant)
            index_entry(tables, txn, key, atime, meta.tenant)
        txn.put(key, meta._replace(atime=max(atime, meta.atime), hits=meta.hits + hits).pack(), db=tables.meta)
