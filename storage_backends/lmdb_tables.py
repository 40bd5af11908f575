"""Record formats of the LMDB tier's tables, and the check that keeps them consistent.

``meta``: key -> (stored size, last access ns, hits, created ns); ``lru``: big-endian last
access ns || key -> empty (keys too long to follow the time are indexed by a digest and kept as
the value); ``info``: ``used`` / ``entries`` totals and ``format``.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections import Counter
from dataclasses import dataclass

from tiered_kv.errors import InvalidKey

META = struct.Struct("<QQIQ")  # stored size, last access ns, hits, created ns
U64 = struct.Struct("<Q")
STAMP = struct.Struct(">Q")  # LRU keys sort by time
FORMAT = 1
MAX_KEY = 511  # LMDB's default key size limit


def as_key(key) -> bytes:
    if isinstance(key, bytes):
        return key
    if isinstance(key, (bytearray, memoryview)):
        return bytes(key)
    raise InvalidKey(f"lmdb keys are bytes, got {type(key).__name__}")


def fits(key: bytes) -> bool:
    return 0 < len(key) <= MAX_KEY


def stamp_of(atime_ns: int, key: bytes) -> bytes:
    """LRU index key: time || key (|| a digest of keys too long to follow the time; their
    index entry then holds the key as its value)."""
    return STAMP.pack(atime_ns) + (key if len(key) <= MAX_KEY - STAMP.size else _digest(key))


def _digest(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=16).digest()


def lru_value(key: bytes) -> bytes:
    return key if len(key) > MAX_KEY - STAMP.size else b""


def indexed(stamp, value) -> bytes:
    """The key an LRU index entry stands for."""
    return bytes(value) if len(value) else bytes(stamp[STAMP.size:])


@dataclass(frozen=True)
class Tables:
    """The handles of the named databases of one environment."""

    blocks: object
    meta: object
    lru: object
    info: object

    NAMES = (b"blocks", b"meta", b"lru", b"info")


class Write:
    """One write transaction: totals read once and written once, counters applied on commit."""

    __slots__ = ("txn", "used", "entries", "counts")

    def __init__(self, txn, used: int, entries: int) -> None:
        self.txn, self.used, self.entries, self.counts = txn, used, entries, Counter()


def read_totals(tables, txn) -> tuple[int, int]:
    """(used bytes, entries) from the ``info`` table."""
    used, entries = txn.get(b"used", db=tables.info), txn.get(b"entries", db=tables.info)
    return (U64.unpack(used)[0] if used else 0, U64.unpack(entries)[0] if entries else 0)


def check_tables(tables, txn, w: Write | None) -> list[str]:
    """Problems between the ``blocks``, ``meta``, ``lru`` and ``info`` tables of ``tables``
    (an object with those handles; the block table is the truth), repaired through ``w`` when
    given (a write transaction whose totals are written on commit)."""
    blocks = {bytes(k): len(v) for k, v in txn.cursor(db=tables.blocks)}
    metas = {bytes(k): META.unpack(v) for k, v in txn.cursor(db=tables.meta)}
    stamps = {bytes(stamp): indexed(stamp, value) for stamp, value in txn.cursor(db=tables.lru)}
    problems = []
    for key, size in blocks.items():
        meta = metas.get(key)
        if meta is None:
            problems.append(f"block without meta: {key.hex()}")
            meta = (size, 0, 0, time.time_ns())  # unknown history: the first to go
            stamps[stamp_of(0, key)] = key
            if w is not None:
                txn.put(stamp_of(0, key), lru_value(key), db=tables.lru)
        elif meta[0] != size:
            problems.append(f"meta size {meta[0]} != stored size {size}: {key.hex()}")
            meta = (size, *meta[1:])
        else:
            continue
        metas[key] = meta
        if w is not None:
            txn.put(key, META.pack(*meta), db=tables.meta)
    for key in [k for k in metas if k not in blocks]:
        problems.append(f"meta without block: {key.hex()}")
        stamp = stamp_of(metas.pop(key)[1], key)
        stamps.pop(stamp, None)
        if w is not None:
            txn.delete(key, db=tables.meta)
            txn.delete(stamp, db=tables.lru)
    wanted = {stamp_of(m[1], k): k for k, m in metas.items()}
    missing, stale = sorted(wanted.keys() - stamps.keys()), sorted(stamps.keys() - wanted.keys())
    problems += [f"missing LRU entry: {wanted[stamp].hex()}" for stamp in missing]
    problems += [f"stale LRU entry: {stamps[stamp].hex()}" for stamp in stale]
    used, entries = read_totals(tables, txn)
    truth = (sum(blocks.values()), len(blocks))
    if (used, entries) != truth:
        problems.append(f"info totals {used} bytes / {entries} entries, tables hold "
                        f"{truth[0]} / {truth[1]}")
    if w is not None:
        for stamp in missing:
            txn.put(stamp, lru_value(wanted[stamp]), db=tables.lru)
        for stamp in stale:
            txn.delete(stamp, db=tables.lru)
        w.used, w.entries = truth
    return problems
