"""Record formats of the LMDB tier's tables, and the totals kept with them.

- ``meta``: key -> (stored size, last access ns, hits, created ns) || tenant label (format 1
  records, without a label, read as tenant ``b""``);
- ``lru``: big-endian last access ns || key -> empty (keys too long to follow the time are
  indexed by a digest and kept as the value);
- ``tenant_lru``: len(tenant) || tenant || the same as ``lru``: each tenant's entries in access
  order, so a tenant over its quota finds its own oldest entries without a scan;
- ``tenants``: len(tenant) || tenant -> (used bytes, entries) of that tenant;
- ``info``: ``used`` / ``entries`` totals and ``format``;
- ``places``: key -> where a value kept in a segment file lies (:mod:`storage_backends.lmdb_segments`;
  a key is in ``blocks`` or in ``places``, never both);
- ``segments``: segment id -> its record (live bytes and entries, end, owner, sealed);
  ``segment_keys``: segment id || key -> empty, the entries of each segment.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

from storage_backends.quotas import MAX_TENANT
from tiered_kv.errors import DamagedRecord, InvalidKey

META = struct.Struct("<QQIQ")  # stored size, last access ns, hits, created ns (then the tenant)
U64 = struct.Struct("<Q")
TOTALS = struct.Struct("<QQ")  # used bytes, entries
STAMP = struct.Struct(">Q")  # LRU keys sort by time
FORMAT = 3  # 3: segment files (places, segments, segment_keys); 2: tenants; older are upgraded on open
MAX_KEY = 511  # LMDB's default key size limit


class Meta(NamedTuple):
    size: int
    atime: int  # last access ns
    hits: int
    created: int  # ns
    tenant: bytes = b""

    def pack(self) -> bytes:
        return META.pack(self.size, self.atime, min(self.hits, 2**32 - 1), self.created) + self.tenant


def unpack_meta(record, key: bytes = b"") -> Meta:
    """A meta record; DamagedRecord when it is too short to be one or its tenant tail is longer
    than a tenant label can be (``key``: named in the message)."""
    if not META.size <= len(record) <= META.size + MAX_TENANT:
        raise DamagedRecord(f"unreadable meta record ({len(record)} bytes): {bytes(key).hex()}")
    return Meta(*META.unpack_from(record), bytes(record[META.size:]))


def as_key(key) -> bytes:
    if isinstance(key, bytes):
        return key
    if isinstance(key, (bytearray, memoryview)):
        return bytes(key)
    raise InvalidKey(f"lmdb keys are bytes, got {type(key).__name__}")


def fits(key: bytes) -> bool:
    return 0 < len(key) <= MAX_KEY


# -- LRU index entries ----------------------------------------------------------------------------
def tenant_prefix(tenant: bytes) -> bytes:
    """The tenant's part of its ``tenant_lru`` and ``tenants`` keys (never empty)."""
    return bytes([len(tenant)]) + tenant


def stamp_of(atime_ns: int, key: bytes, prefix: bytes = b"") -> bytes:
    """LRU index key: prefix || time || key (|| a digest of keys too long to follow; their
    index entry then holds the key as its value)."""
    head = prefix + STAMP.pack(atime_ns)
    return head + (key if len(head) + len(key) <= MAX_KEY else _digest(key))


def tenant_stamp(tenant: bytes, atime_ns: int, key: bytes) -> bytes:
    return stamp_of(atime_ns, key, tenant_prefix(tenant))


def lru_value(key: bytes, prefix: bytes = b"") -> bytes:
    return key if len(prefix) + STAMP.size + len(key) > MAX_KEY else b""


def indexed(stamp, value, prefix_len: int = 0) -> bytes:
    """The key an LRU index entry stands for."""
    return bytes(value) if len(value) else bytes(stamp[prefix_len + STAMP.size:])


def atime_of(stamp, prefix_len: int = 0) -> int:
    return STAMP.unpack_from(stamp, prefix_len)[0]


def _digest(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=16).digest()


# -- totals ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tables:
    """The handles of the named databases of one environment."""

    blocks: object
    meta: object
    lru: object
    info: object
    tenant_lru: object
    tenants: object
    places: object
    segments: object
    segment_keys: object

    NAMES = (b"blocks", b"meta", b"lru", b"info", b"tenant_lru", b"tenants", b"places", b"segments",
             b"segment_keys")


def read_totals(tables: Tables, txn) -> tuple[int, int]:
    """(used bytes, entries) from the ``info`` table."""
    used, entries = txn.get(b"used", db=tables.info), txn.get(b"entries", db=tables.info)
    return (U64.unpack(used)[0] if used else 0, U64.unpack(entries)[0] if entries else 0)


def read_tenant(tables: Tables, txn, tenant: bytes) -> tuple[int, int]:
    """(used bytes, entries) of ``tenant``."""
    record = txn.get(tenant_prefix(tenant), db=tables.tenants)
    return TOTALS.unpack(record) if record is not None else (0, 0)


def tenant_totals(tables: Tables, txn) -> dict[bytes, tuple[int, int]]:
    """tenant -> (used bytes, entries), every tenant holding something."""
    return {bytes(k[1:]): TOTALS.unpack(v) for k, v in txn.cursor(db=tables.tenants)}


class Write:
    """One write transaction: the totals (overall and of the tenants it touches) read once,
    written once by :meth:`save`; counters applied on commit."""

    __slots__ = ("txn", "tables", "used", "entries", "counts", "changes", "drained", "_start", "_tenants",
                 "_tenants_start")

    def __init__(self, txn, tables: Tables) -> None:
        self.txn, self.tables, self.counts = txn, tables, Counter()
        self.changes: list[tuple[str, bytes]] = []  # ("stored" | "removed", key), in order
        self.drained: list[int] = []  # segments whose files go once this transaction commits
        self.used, self.entries = self._start = read_totals(tables, txn)
        self._tenants: dict[bytes, list[int]] = {}  # tenant -> [used, entries] now
        self._tenants_start: dict[bytes, tuple[int, int]] = {}  # as read

    def tenant_used(self, tenant: bytes) -> int:
        return self._tenant(tenant)[0]

    def add(self, tenant: bytes, size: int, entries: int) -> None:
        """``entries`` entries of ``size`` bytes in all came (negative: went) for ``tenant``."""
        self.used += size
        self.entries += entries
        mine = self._tenant(tenant)
        mine[0] += size
        mine[1] += entries

    def _tenant(self, tenant: bytes) -> list[int]:
        if tenant not in self._tenants:
            self._tenants_start[tenant] = read_tenant(self.tables, self.txn, tenant)
            self._tenants[tenant] = list(self._tenants_start[tenant])
        return self._tenants[tenant]

    def save(self) -> None:
        """Write the totals that changed (a tenant that holds nothing loses its record)."""
        if (self.used, self.entries) != self._start:
            self.txn.put(b"used", U64.pack(max(0, self.used)), db=self.tables.info)
            self.txn.put(b"entries", U64.pack(max(0, self.entries)), db=self.tables.info)
        for tenant, (used, entries) in self._tenants.items():
            if (used, entries) == self._tenants_start[tenant]:
                continue
            if entries > 0:
                self.txn.put(tenant_prefix(tenant), TOTALS.pack(max(0, used), entries), db=self.tables.tenants)
            else:
                self.txn.delete(tenant_prefix(tenant), db=self.tables.tenants)
        self._start, self._tenants, self._tenants_start = (self.used, self.entries), {}, {}
