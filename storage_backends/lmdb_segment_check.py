"""The consistency check of the LMDB tier's segment files and their tables: every place must lie
inside an existing segment file, the ``segment_keys`` index and each segment's live totals must
follow the places, and files no record names are orphans. Problems are repaired when a write
transaction is given (a broken place is dropped; the table check then drops its meta record).

The files are listed after the transaction began: without a write transaction (which no other
process can commit beside), another process may commit meanwhile (a compaction moving values out
of a segment and deleting its file, a writer opening a segment). What the listing and the tables
disagree on is therefore looked at again in a transaction begun after the listing (``fresh``)
before it is reported: a value whose place changed meanwhile was sound where the check's
transaction saw it, a segment whose record went meanwhile had drained, and a file is an orphan
only when no record names it then and it is still there after. A file whose deletion waits for
the commit that drained it to be durable (locked: :func:`storage_backends.segment_fds.being_deleted`)
is no orphan either, nor deleted by a fix."""

from __future__ import annotations

import struct
from collections.abc import Callable
from contextlib import AbstractContextManager

from storage_backends.lmdb_places import register_segment
from storage_backends.lmdb_segments import (
    Place,
    SegmentFiles,
    SegmentRecord,
    segment_key,
    unpack_place,
    unpack_segment,
    within,
)
from storage_backends.lmdb_tables import Tables, Write
from storage_backends.segment_fds import being_deleted
from storage_backends.segment_owners import owner_alive

FreshView = Callable[[], AbstractContextManager]  # a read transaction begun now


def check_segments(tables: Tables, txn, w: Write | None, files: SegmentFiles,
                   fresh: FreshView | None = None) -> tuple[list[str], dict[bytes, int]]:
    """(problems, key -> length of every value whose place is sound). Without ``w``, ``fresh``
    (a read transaction of the same environment) tells races with other processes' commits
    from damage; without it every disagreement is reported."""
    problems: list[str] = []
    sizes = {s: n for s in files.files() if (n := files.file_size(s)) is not None}
    records = {int.from_bytes(bytes(k), "big"): unpack_segment(v) for k, v in txn.cursor(db=tables.segments)}
    placed: dict[bytes, int] = {}
    live: dict[int, list[int]] = {}
    index: set[bytes] = set()
    broken: list[bytes] = []
    outside: dict[bytes, tuple[bytes, Place, str]] = {}  # key -> (its place record, place, why)
    for key, record in txn.cursor(db=tables.places):
        key = bytes(key)
        try:
            place = unpack_place(record)
        except struct.error:
            problems.append(f"unreadable place: {key.hex()}")
            broken.append(key)
            continue
        size = sizes.get(place.segment)
        if not within(place, size):
            where = "in a missing segment" if size is None else f"beyond the end of segment {place.segment:016x}"
            outside[key] = (bytes(record), place, where)
            continue
        _sound(key, place, placed, live, index)
    missing = {s for s, r in records.items() if s not in sizes and (r.sealed or not owner_alive(r))}
    if w is None and fresh is not None and (outside or missing or sizes.keys() - records.keys() - live.keys()):
        orphans = _settled(tables, fresh, files, outside, missing, sizes, records, (placed, live, index))
    else:
        orphans = {s for s in sizes.keys() - records.keys() - live.keys() if _left(files, s)}
    for key, (_, _, where) in outside.items():
        problems.append(f"value {where}: {key.hex()}")
        broken.append(key)
    found = {bytes(k) for k, _ in txn.cursor(db=tables.segment_keys)}
    problems += [f"missing segment index entry: {k[8:].hex()}" for k in sorted(index - found)]
    problems += [f"stale segment index entry: {k[8:].hex()}" for k in sorted(found - index)]
    for segment, record in sorted(records.items()):
        have = live.get(segment, [0, 0])
        if (record.live_bytes, record.live_entries) != tuple(have):
            problems.append(f"segment {segment:016x} counts {record.live_bytes} bytes / {record.live_entries} "
                            f"entries, its places hold {have[0]} / {have[1]}")
        if segment in missing:
            problems.append(f"segment record without its file: {segment:016x}")
    problems += [f"segment without a record: {s:016x}" for s in sorted(live.keys() - records.keys())]
    problems += [f"orphan segment file: {s:016x}" for s in sorted(orphans)]
    if w is not None:
        _repair(tables, w, broken, index, found, records, live, sizes, missing, sorted(orphans))
    return problems, placed


def _sound(key: bytes, place: Place, placed: dict[bytes, int], live: dict[int, list[int]], index: set[bytes]) -> None:
    placed[key] = place.length
    totals = live.setdefault(place.segment, [0, 0])
    totals[0] += place.length
    totals[1] += 1
    index.add(segment_key(place.segment) + key)


def _settled(tables: Tables, fresh: FreshView, files: SegmentFiles, outside: dict[bytes, tuple[bytes, Place, str]],
             missing: set[int], sizes: dict[int, int], records: dict[int, SegmentRecord], sound: tuple) -> set[int]:
    """Look again, after the listing, at what it and the check's transaction disagree on, and
    take out what another process's commit explains: a value whose place changed is sound
    (``sound``: what :func:`_sound` adds to), a segment whose record went had drained, a file a
    record names now or that is gone is no orphan. The orphans."""
    with fresh() as now:
        for key, (record, place, _) in list(outside.items()):
            current = now.get(key, db=tables.places)
            if current is None or bytes(current) != record:  # (places are never reused)
                del outside[key]
                _sound(key, place, *sound)
        missing -= {s for s in missing if now.get(segment_key(s), db=tables.segments) is None}
        orphans = {s for s in sizes.keys() - records.keys() - sound[1].keys()
                   if now.get(segment_key(s), db=tables.segments) is None}
    return {s for s in orphans if _left(files, s)}


def _left(files: SegmentFiles, segment: int) -> bool:
    """Whether ``segment``'s file (which no record names) is left: nobody holds it for deletion,
    and it is still there after that was looked at (a file deleted meanwhile is not locked any
    more: :func:`being_deleted` cannot tell, so the look for the file comes after it)."""
    return not being_deleted(files.path_of(segment)) and files.file_size(segment) is not None


def _repair(tables: Tables, w: Write, broken: list[bytes], index: set[bytes], found: set[bytes],
            records: dict[int, SegmentRecord], live: dict[int, list[int]], sizes: dict[int, int],
            missing: set[int], orphans: list[int]) -> None:
    txn = w.txn
    for key in broken:
        txn.delete(key, db=tables.places)
    for entry in index - found:
        txn.put(entry, b"", db=tables.segment_keys)
    for entry in found - index:
        txn.delete(entry, db=tables.segment_keys)
    for segment, record in records.items():
        have = live.get(segment, [0, 0])
        if segment in missing or (record.sealed and not have[1]):
            txn.delete(segment_key(segment), db=tables.segments)
            w.drained.append(segment)
        elif (record.live_bytes, record.live_entries) != tuple(have):
            register_segment(tables, w, segment, record._replace(live_bytes=have[0], live_entries=have[1]))
    for segment in live.keys() - records.keys():
        register_segment(tables, w, segment, SegmentRecord(*live[segment], sizes.get(segment) or 0, 0, 0, True))
    w.drained.extend(orphans)
