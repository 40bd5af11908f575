"""Values kept in segment files, inside one LMDB write transaction: record a place, drop one
(a segment that is sealed and holds nothing more is dropped, its file deleted after the commit:
``Write.drained``), register and seal segments, and recover segments whose process died."""

from __future__ import annotations

import logging

from storage_backends.lmdb_segments import (
    Place,
    SegmentFiles,
    SegmentRecord,
    segment_key,
    unpack_place,
    unpack_segment,
)
from storage_backends.lmdb_tables import Tables, Write
from storage_backends.segment_owners import owner_alive

log = logging.getLogger(__name__)


def place_value(tables: Tables, w: Write, key: bytes, place: Place) -> None:
    """Record that ``key``'s value lies at ``place`` (its old entry removed by the caller)."""
    w.txn.put(key, place.pack(), db=tables.places)
    w.txn.put(segment_key(place.segment) + key, b"", db=tables.segment_keys)
    _count(tables, w, place.segment, place.length, 1, place.offset + place.length)


def unplace(tables: Tables, w: Write, key: bytes) -> bool:
    """Forget where ``key``'s value lies; whether it was in a segment."""
    record = w.txn.get(key, db=tables.places)
    if record is None:
        return False
    place = unpack_place(record)
    w.txn.delete(key, db=tables.places)
    w.txn.delete(segment_key(place.segment) + key, db=tables.segment_keys)
    _count(tables, w, place.segment, -place.length, -1, 0)
    return True


def keys_in(tables: Tables, txn, segment: int):
    """The keys of the values ``segment`` holds (its ``segment_keys`` entries)."""
    prefix = segment_key(segment)
    cursor = txn.cursor(db=tables.segment_keys)
    if cursor.set_range(prefix):
        for entry in cursor.iternext(keys=True, values=False):
            if bytes(entry[:8]) != prefix:
                break
            yield bytes(entry[8:])


def _count(tables: Tables, w: Write, segment: int, nbytes: int, entries: int, end: int) -> None:
    sid = segment_key(segment)
    stored = w.txn.get(sid, db=tables.segments)
    if stored is None and entries < 0:
        return  # damage (a place whose segment has no record): check() reports it
    record = unpack_segment(stored) if stored is not None else SegmentRecord(0, 0, 0, 0, 0, True)
    record = record._replace(live_bytes=record.live_bytes + nbytes, live_entries=record.live_entries + entries,
                             end=max(record.end, end))
    if record.sealed and record.live_entries <= 0:
        w.txn.delete(sid, db=tables.segments)
        w.drained.append(segment)
    else:
        w.txn.put(sid, record.pack(), db=tables.segments)


def register_segment(tables: Tables, w: Write, segment: int, record: SegmentRecord) -> None:
    w.txn.put(segment_key(segment), record.pack(), db=tables.segments)


def seal_segments(tables: Tables, w: Write, ends: dict[int, int]) -> None:
    """Seal segments no process appends to any more (id -> bytes appended); those holding
    nothing are dropped."""
    for segment, end in ends.items():
        sid = segment_key(segment)
        stored = w.txn.get(sid, db=tables.segments)
        if stored is None:
            continue
        record = unpack_segment(stored)._replace(owner_pid=0, owner_start=0, owner_ns=0, sealed=True)
        record = record._replace(end=max(record.end, end))
        if record.live_entries <= 0:
            w.txn.delete(sid, db=tables.segments)
            w.drained.append(segment)
        else:
            w.txn.put(sid, record.pack(), db=tables.segments)


def recover_segments(tables: Tables, w: Write, files: SegmentFiles) -> tuple[int, int]:
    """Seal the segments of processes that are gone, drop the empty ones, and mark the files
    no record names (a crash between dropping a record and deleting its file) for deletion.
    (segments sealed, orphan files)."""
    records = {int.from_bytes(bytes(k), "big"): unpack_segment(v) for k, v in w.txn.cursor(db=tables.segments)}
    dead = {s: max(r.end, files.file_size(s) or 0) for s, r in records.items()
            if not r.sealed and not owner_alive(r, files.path_of(s))}
    seal_segments(tables, w, dead)
    orphans = [s for s in files.files() if s not in records]
    w.drained.extend(orphans)
    return len(dead), len(orphans)
