"""The consistency check of the LMDB tier's tables: the block table and the sound places are the truth; meta records,
both LRU indexes and the totals (overall and per tenant) must follow it. Problems are repaired
when a write transaction is given. A format 1 store opened read-only has no tenant tables yet
(its first write derives them from the meta records): their check is left out, and said so."""

from __future__ import annotations

import time

from storage_backends.base import Unchecked
from storage_backends.lmdb_format import stored_format
from storage_backends.lmdb_missing import MissingTable
from storage_backends.lmdb_tables import (
    TOTALS,
    Meta,
    Tables,
    Write,
    indexed,
    lru_value,
    read_totals,
    stamp_of,
    tenant_prefix,
    tenant_stamp,
    tenant_totals,
    unpack_meta,
)
from tiered_kv.errors import DamagedRecord


def check_tables(tables: Tables, txn, w: Write | None, placed: dict[bytes, int] | None = None) -> list[str]:
    """Problems between the tables, repaired through ``w`` when given (a write transaction
    whose totals are written on commit). ``placed``: the values in segment files (key ->
    length, as :func:`storage_backends.lmdb_segment_check.check_segments` found them sound).
    Without the tenant tables (a read-only open of format 1) the answer ends in an
    :class:`~storage_backends.base.Unchecked` line instead of their check."""
    blocks = {bytes(k): len(v) for k, v in txn.cursor(db=tables.blocks)}
    problems: list[str] = []
    for key, size in (placed or {}).items():
        if key in blocks:  # the segment's copy is kept (check_segments found it sound), LMDB's goes
            problems.append(f"value both in the block table and in a segment: {key.hex()}")
            if w is not None:
                txn.delete(key, db=tables.blocks)
        blocks[key] = size
    metas = _metas(tables, txn, w, problems)
    for key, size in blocks.items():
        meta = metas.get(key)
        if meta is None:
            problems.append(f"block without meta: {key.hex()}")
            meta = Meta(size, 0, 0, time.time_ns())  # unknown history (and tenant): the first to go
        elif meta.size != size:
            problems.append(f"meta size {meta.size} != stored size {size}: {key.hex()}")
            meta = meta._replace(size=size)
        else:
            continue
        metas[key] = meta
        if w is not None:
            txn.put(key, meta.pack(), db=tables.meta)
    for key in [k for k in metas if k not in blocks]:
        problems.append(f"meta without block: {key.hex()}")
        del metas[key]
        if w is not None:
            txn.delete(key, db=tables.meta)
    problems += _check_index(txn, w, tables.lru, "LRU entry", b"",
                             {stamp_of(m.atime, k): (k, lru_value(k)) for k, m in metas.items()})
    by_tenant = not any(isinstance(t, MissingTable) for t in (tables.tenant_lru, tables.tenants))
    if by_tenant:
        wanted = {tenant_stamp(m.tenant, m.atime, k): (k, lru_value(k, tenant_prefix(m.tenant)))
                  for k, m in metas.items()}
        problems += _check_index(txn, w, tables.tenant_lru, "tenant LRU entry", None, wanted)
    problems += _check_totals(tables, txn, w, metas, by_tenant)
    if not by_tenant:
        problems.append(Unchecked(f"format {stored_format(tables, txn)}: upgraded by the first write; "
                                  "tenant bookkeeping not checked"))
    return problems


def _metas(tables: Tables, txn, w: Write | None, problems: list[str]) -> dict[bytes, Meta]:
    """Every readable meta record (unreadable ones, too short or with a tenant tail longer than a
    label, are problems, deleted with ``w``: their values are then blocks without meta, rebuilt)."""
    metas, unreadable = {}, []
    for key, record in txn.cursor(db=tables.meta):
        try:
            metas[bytes(key)] = unpack_meta(record, key)
        except DamagedRecord:
            unreadable.append(bytes(key))
    problems += [f"unreadable meta record: {key.hex()}" for key in unreadable]
    for key in unreadable if w is not None else ():
        txn.delete(key, db=tables.meta)
    return metas


def _check_index(txn, w: Write | None, db, what: str, prefix: bytes | None,
                 wanted: dict[bytes, tuple[bytes, bytes]]) -> list[str]:
    """``db`` against ``wanted`` (index key -> (key, value)); ``prefix`` None: each entry starts
    with its tenant's length byte and label."""
    found = {}
    for stamp, value in txn.cursor(db=db):
        skip = len(prefix) if prefix is not None else 1 + stamp[0]
        found[bytes(stamp)] = indexed(stamp, value, skip)
    missing, stale = sorted(wanted.keys() - found.keys()), sorted(found.keys() - wanted.keys())
    problems = [f"missing {what}: {wanted[s][0].hex()}" for s in missing]
    problems += [f"stale {what}: {found[s].hex()}" for s in stale]
    if w is not None:
        for stamp in missing:
            txn.put(stamp, wanted[stamp][1], db=db)
        for stamp in stale:
            txn.delete(stamp, db=db)
    return problems


def _check_totals(tables: Tables, txn, w: Write | None, metas: dict[bytes, Meta], by_tenant: bool) -> list[str]:
    problems = []
    truth = (sum(m.size for m in metas.values()), len(metas))
    used, entries = read_totals(tables, txn)
    if (used, entries) != truth:
        problems.append(f"info totals {used} bytes / {entries} entries, tables hold {truth[0]} / {truth[1]}")
    if w is not None:
        w.used, w.entries = truth
    if not by_tenant:
        return problems
    per_tenant: dict[bytes, tuple[int, int]] = {}
    for m in metas.values():
        n, count = per_tenant.get(m.tenant, (0, 0))
        per_tenant[m.tenant] = (n + m.size, count + 1)
    recorded = tenant_totals(tables, txn)
    for tenant in sorted(per_tenant.keys() | recorded.keys()):
        have, want = recorded.get(tenant, (0, 0)), per_tenant.get(tenant, (0, 0))
        if have != want:
            problems.append(f"tenant totals of {tenant.hex() or '-'}: {have[0]} bytes / {have[1]} "
                            f"entries, tables hold {want[0]} / {want[1]}")
            if w is not None and want[1]:
                txn.put(tenant_prefix(tenant), TOTALS.pack(*want), db=tables.tenants)
            elif w is not None:
                txn.delete(tenant_prefix(tenant), db=tables.tenants)
    return problems
