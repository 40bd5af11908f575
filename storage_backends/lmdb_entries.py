"""Entry operations of the LMDB tier inside one write transaction: put, remove, evict the least
recently used, and apply buffered read accesses. ``tables`` is an object with the ``blocks``,
``meta`` and ``lru`` table handles (:class:`storage_backends.lmdb_tables.Tables`)."""

from __future__ import annotations

import time
from collections.abc import Callable

from storage_backends.lmdb_tables import META, STAMP, Write, indexed, lru_value, stamp_of


def put_entry(tables, w: Write, key: bytes, value, size: int, capacity: int,
              pinned: Callable[[], set[bytes]]) -> bool:
    """Store ``value`` under ``key``, evicting unpinned entries to stay within ``capacity``;
    False (counted as rejected) when it cannot fit."""
    if size > capacity:
        w.counts["put_rejected"] += 1
        return False
    remove_entry(tables, w, key)  # an overwrite replaces the old entry
    evict_lru(tables, w, size, capacity, pinned)
    if w.used + size > capacity:  # the rest is pinned
        w.counts["put_rejected"] += 1
        return False
    now = time.time_ns()
    w.txn.put(key, value, db=tables.blocks)
    w.txn.put(key, META.pack(size, now, 0, now), db=tables.meta)
    w.txn.put(stamp_of(now, key), lru_value(key), db=tables.lru)
    w.used += size
    w.entries += 1
    w.counts["puts"] += 1
    w.counts["bytes_in"] += size
    return True


def remove_entry(tables, w: Write, key: bytes) -> bool:
    """Delete ``key`` from every table; whether it was there."""
    meta = w.txn.get(key, db=tables.meta)
    if meta is not None:
        size, atime = META.unpack(meta)[:2]  # before any write invalidates the buffer
        w.txn.delete(stamp_of(atime, key), db=tables.lru)
        w.txn.delete(key, db=tables.meta)
        w.used -= size
        w.entries -= 1
    return w.txn.delete(key, db=tables.blocks) or meta is not None


def evict_lru(tables, w: Write, incoming: int, capacity: int, pinned: Callable[[], set[bytes]]) -> int:
    """Delete least recently used entries not in ``pinned()`` until ``incoming`` bytes fit."""
    if w.used + incoming <= capacity:
        return 0
    keep = pinned()
    victims, stale = [], []
    for stamp, value in w.txn.cursor(db=tables.lru):
        if w.used + incoming <= capacity:
            break
        key = indexed(stamp, value)
        if key in keep:
            continue
        meta = w.txn.get(key, db=tables.meta)
        if meta is None or META.unpack(meta)[1] != STAMP.unpack(stamp[:STAMP.size])[0]:
            stale.append(bytes(stamp))  # left over by damage; not the key's real position
            continue
        victims.append(key)
        w.used -= META.unpack(meta)[0]
        w.entries -= 1
    for stamp in stale:
        w.txn.delete(stamp, db=tables.lru)
    for key in victims:
        meta = META.unpack(w.txn.get(key, db=tables.meta))
        w.txn.delete(stamp_of(meta[1], key), db=tables.lru)
        w.txn.delete(key, db=tables.meta)
        w.txn.delete(key, db=tables.blocks)
    w.counts["evictions"] += len(victims)
    return len(victims)


def apply_accesses(tables, txn, touches: dict[bytes, tuple[int, int]]) -> None:
    """Record buffered reads (key -> (last access ns, hits)) in the meta and LRU tables."""
    for key, (atime, hits) in touches.items():
        meta = txn.get(key, db=tables.meta)
        if meta is None:
            continue  # evicted or deleted meanwhile (maybe by another process)
        size, old_atime, old_hits, created = META.unpack(meta)
        if atime > old_atime:
            txn.delete(stamp_of(old_atime, key), db=tables.lru)
            txn.put(stamp_of(atime, key), lru_value(key), db=tables.lru)
        txn.put(key, META.pack(size, max(atime, old_atime), min(old_hits + hits, 2**32 - 1),
                               created), db=tables.meta)
