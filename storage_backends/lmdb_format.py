"""The format of an LMDB tier environment, and the upgrade of older formats in place.

Format 1 had no tenants. Format 2 adds the tenant label to meta records (a suffix: a format 1
record is a format 2 record of tenant ``b""``), the ``tenant_lru`` index and the ``tenants``
totals. Format 3 adds segment files (the ``places``, ``segments`` and ``segment_keys`` tables,
empty in an upgraded environment: its values stay where they are). The upgrade from 1 indexes every entry under tenant ``b""`` in one write transaction, so several
processes opening an old environment at once upgrade it exactly once; a process of the previous
version then refuses the environment (format 2) rather than miscount it.
"""

from __future__ import annotations

import logging

from storage_backends.lmdb_damage import read_meta
from storage_backends.lmdb_tables import (
    FORMAT,
    TOTALS,
    U64,
    Tables,
    Write,
    lru_value,
    tenant_prefix,
    tenant_stamp,
)

log = logging.getLogger(__name__)

CHUNK = 4096  # meta records copied out per cursor pass (their buffers end with the next write)


READABLE = (None, 1, 2, FORMAT)  # formats read as they are (a read-only open); a write settles them


def format_refusal(path: object, found: int | None, *, doing: str = "reads") -> str:
    """Why the environment at ``path``, of format ``found``, is refused: the one wording of it,
    whether an open or the first write after a read-only open finds it."""
    return f"lmdb store at {path} has format {found}, this version {doing} {FORMAT}"


def foreign(env) -> bool:
    """Whether ``env``'s main table holds anything but this store's tables (every version kept
    its data in named tables, which LMDB lists in the main table): another program's LMDB
    environment, which no open may take for a new store and create tables in."""
    with env.begin() as txn:
        return any(bytes(key) not in Tables.NAMES for key in txn.cursor().iternext(values=False))


def stored_format(tables: Tables, txn) -> int | None:
    """The environment's format (None: a new one)."""
    stored = txn.get(b"format", db=tables.info)
    return U64.unpack(stored)[0] if stored is not None else None


def settle_format(tables: Tables, w: Write) -> int:
    """The environment's format after this: a new one is written as FORMAT, format 1 is
    upgraded to it; any other is left alone and returned (the caller refuses it)."""
    found = stored_format(tables, w.txn)
    if found == 1:
        _index_tenants(tables, w)
    if found in (None, 1, 2):  # 2 -> 3 adds empty tables only
        w.txn.put(b"format", U64.pack(FORMAT), db=tables.info)
        return FORMAT
    return found


def _index_tenants(tables: Tables, w: Write) -> None:
    """Every entry of a format 1 environment becomes tenant b""'s: its ``tenant_lru`` entry and
    the tenant's totals."""
    used = entries = 0
    start = b""
    while True:
        cursor = w.txn.cursor(db=tables.meta)
        batch = []
        if cursor.set_range(start):
            for key, record in cursor:  # (a damaged record is left out: counted, check() reports it)
                batch.append((bytes(key), read_meta(w, bytes(key), record)))
                if len(batch) == CHUNK:
                    break
        for key, meta in batch:
            if meta is None:
                continue
            w.txn.put(tenant_stamp(b"", meta.atime, key), lru_value(key, tenant_prefix(b"")), db=tables.tenant_lru)
            used, entries = used + meta.size, entries + 1
        if len(batch) < CHUNK:
            break
        start = batch[-1][0] + b"\0"  # the next key after the last one copied
    if entries:
        w.txn.put(tenant_prefix(b""), TOTALS.pack(used, entries), db=tables.tenants)
    log.info("lmdb tier: format 1 upgraded to %d (%d entries, %d bytes, all of tenant b'')",
             FORMAT, entries, used)
