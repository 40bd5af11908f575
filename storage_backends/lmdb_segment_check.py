"""The consistency check of the LMDB tier's segment files and their tables: every place must lie
inside an existing segment file, the ``segment_keys`` index and each segment's live totals must
follow the places, and files no record names are orphans. Problems are repaired when a write
transaction is given (a broken place is dropped; the table check then drops its meta record)."""

from __future__ import annotations

import struct

from storage_backends.lmdb_places import register_segment
from storage_backends.lmdb_segments import (
    SegmentFiles,
    SegmentRecord,
    segment_key,
    unpack_place,
    unpack_segment,
)
from storage_backends.lmdb_tables import Tables, Write
from storage_backends.segment_owners import owner_alive


def check_segments(tables: Tables, txn, w: Write | None, files: SegmentFiles) -> tuple[list[str], dict[bytes, int]]:
    """(problems, key -> length of every value whose place is sound)."""
    problems: list[str] = []
    sizes = {s: files.file_size(s) for s in files.files()}
    records = {int.from_bytes(bytes(k), "big"): unpack_segment(v) for k, v in txn.cursor(db=tables.segments)}
    placed: dict[bytes, int] = {}
    live: dict[int, list[int]] = {}
    index: set[bytes] = set()
    broken: list[bytes] = []
    for key, record in txn.cursor(db=tables.places):
        key = bytes(key)
        try:
            place = unpack_place(record)
        except struct.error:
            problems.append(f"unreadable place: {key.hex()}")
            broken.append(key)
            continue
        size = sizes.get(place.segment)
        if size is None or place.offset + place.length > size:
            where = "in a missing segment" if size is None else f"beyond the end of segment {place.segment:016x}"
            problems.append(f"value {where}: {key.hex()}")
            broken.append(key)
            continue
        placed[key] = place.length
        totals = live.setdefault(place.segment, [0, 0])
        totals[0] += place.length
        totals[1] += 1
        index.add(segment_key(place.segment) + key)
    found = {bytes(k) for k, _ in txn.cursor(db=tables.segment_keys)}
    problems += [f"missing segment index entry: {k[8:].hex()}" for k in sorted(index - found)]
    problems += [f"stale segment index entry: {k[8:].hex()}" for k in sorted(found - index)]
    for segment, record in sorted(records.items()):
        have = live.get(segment, [0, 0])
        if (record.live_bytes, record.live_entries) != tuple(have):
            problems.append(f"segment {segment:016x} counts {record.live_bytes} bytes / {record.live_entries} "
                            f"entries, its places hold {have[0]} / {have[1]}")
        if segment not in sizes and (record.sealed or not owner_alive(record)):
            problems.append(f"segment record without its file: {segment:016x}")
    problems += [f"segment without a record: {s:016x}" for s in sorted(live.keys() - records.keys())]
    orphans = sorted(sizes.keys() - records.keys() - live.keys())
    problems += [f"orphan segment file: {s:016x}" for s in orphans]
    if w is not None:
        _repair(tables, w, files, broken, index, found, records, live, sizes, orphans)
    return problems, placed


def _repair(tables: Tables, w: Write, files: SegmentFiles, broken: list[bytes], index: set[bytes],
            found: set[bytes], records: dict[int, SegmentRecord], live: dict[int, list[int]],
            sizes: dict[int, int | None], orphans: list[int]) -> None:
    txn = w.txn
    for key in broken:
        txn.delete(key, db=tables.places)
    for entry in index - found:
        txn.put(entry, b"", db=tables.segment_keys)
    for entry in found - index:
        txn.delete(entry, db=tables.segment_keys)
    for segment, record in records.items():
        have = live.get(segment, [0, 0])
        gone = segment not in sizes and (record.sealed or not owner_alive(record))
        if gone or (record.sealed and not have[1]):
            txn.delete(segment_key(segment), db=tables.segments)
            w.drained.append(segment)
        elif (record.live_bytes, record.live_entries) != tuple(have):
            register_segment(tables, w, segment, record._replace(live_bytes=have[0], live_entries=have[1]))
    for segment in live.keys() - records.keys():
        register_segment(tables, w, segment, SegmentRecord(*live[segment], sizes.get(segment) or 0, 0, 0, True))
    w.drained.extend(orphans)
