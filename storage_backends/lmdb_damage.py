"""Meta records of the LMDB tier that cannot be read (too short to be one, or a tenant tail longer
than a tenant label can be: :func:`storage_backends.lmdb_tables.unpack_meta` raises
:class:`~tiered_kv.errors.DamagedRecord`). Whoever meets one counts it (``damaged_meta`` in the
backend's stats), logs it (at most once a minute) and goes on without raising: a read access to
its entry is not recorded, eviction may take the entry, and removing it (a delete, an overwrite,
an eviction) drops the record with what of the entry's bookkeeping the indexes still tell.
``check()`` reports it as an unreadable meta record; ``check(fix=True)`` rebuilds it from the
stored value (as a block without meta) and repairs whatever totals are left."""

from __future__ import annotations

import logging
import struct

from storage_backends.lmdb_segments import unpack_place
from storage_backends.lmdb_tables import Meta, Tables, Write, stamp_of, tenant_stamp, unpack_meta
from storage_backends.log_throttle import LogThrottle
from tiered_kv.errors import DamagedRecord

log = logging.getLogger(__name__)
_warnings = LogThrottle(log)  # a damaged entry read again and again: one warning a minute

HEAD = struct.Struct("<QQ")  # the head of a meta record: stored size, last access ns


def read_meta(w: Write, key: bytes, record) -> Meta | None:
    """``key``'s meta ``record`` read; None when it is damaged (counted on ``w``, logged)."""
    try:
        return unpack_meta(record, key)
    except DamagedRecord as exc:
        w.counts["damaged_meta"] += 1
        _warnings.warning("lmdb tier: %s (passed over; check(fix=True) rebuilds it)", exc.detail)
        return None


def stored_size(tables: Tables, txn, key: bytes) -> int:
    """Bytes of ``key``'s stored value (in the block table or a segment); 0 when there is none."""
    value = txn.get(key, db=tables.blocks)
    if value is not None:
        return len(value)
    place = txn.get(key, db=tables.places)
    return unpack_place(place).length if place is not None else 0


def last_access(record) -> int | None:
    """The last access a damaged meta record still holds (None: too short to hold one)."""
    return HEAD.unpack_from(record)[1] if len(record) >= HEAD.size else None


def damaged_victim(tables: Tables, w: Write, key: bytes, record, indexed_at: int) -> int | None:
    """The bytes an eviction frees by taking ``key`` (whose meta ``record`` is damaged), found at
    ``indexed_at`` in an LRU index; None when the record says the entry lies elsewhere (that
    index entry is stale)."""
    atime = last_access(record)
    if atime is not None and atime != indexed_at:
        return None
    return stored_size(tables, w.txn, key)


def drop_damaged(tables: Tables, w: Write, key: bytes, record) -> None:
    """Forget ``key``'s damaged meta ``record``: the stored value's bytes and one entry leave the
    totals (the tenant's too, when its ``tenant_lru`` entry is found at the last access the
    record still holds; else ``check(fix=True)`` repairs the tenant's), and so do its index
    entries (those not found are left stale: eviction and ``check`` drop them)."""
    record = bytes(record)  # (before any write invalidates LMDB's buffer)
    size, atime = stored_size(tables, w.txn, key), last_access(record)
    tenant = _indexed_tenant(tables, w.txn, key, atime) if atime is not None else None
    if atime is not None:
        w.txn.delete(stamp_of(atime, key), db=tables.lru)
    if tenant is not None:
        w.txn.delete(tenant_stamp(tenant, atime, key), db=tables.tenant_lru)
        w.add(tenant, -size, -1)
    else:
        w.used, w.entries = w.used - size, w.entries - 1
    w.txn.delete(key, db=tables.meta)


def _indexed_tenant(tables: Tables, txn, key: bytes, atime: int) -> bytes | None:
    """The tenant whose ``tenant_lru`` holds ``key`` at ``atime`` (one look-up per tenant)."""
    for prefix in txn.cursor(db=tables.tenants).iternext(keys=True, values=False):
        tenant = bytes(prefix[1:])
        if txn.get(tenant_stamp(tenant, atime, key), db=tables.tenant_lru) is not None:
            return tenant
    return None
