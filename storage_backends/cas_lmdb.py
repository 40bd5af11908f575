"""Delete-if-unchanged on the LMDB tier: inside one write transaction (LMDB has one writer at a
time, across processes) each key's value is read and compared with the bytes the caller saw, and
the entry is deleted only when they are equal. A put by any process lands before that
transaction (its value is compared, and differs) or after it (a new entry, kept)."""

from __future__ import annotations

from collections.abc import Sequence

from storage_backends.lmdb_entries import delete_entry
from storage_backends.lmdb_segments import unpack_place
from storage_backends.lmdb_tables import as_key, fits
from storage_backends.lmdb_writes import write_in_parts


def delete_if_unchanged(backend, pairs: Sequence[tuple[bytes, bytes]]) -> list[bool]:
    """Delete each ``(key, value)``'s entry of ``backend`` (an LmdbBackend) whose stored value is
    exactly ``value``; per pair whether it was deleted. A value whose segment no longer holds it
    is not ``value``: left alone."""
    items = [(as_key(k), memoryview(v).cast("B")) for k, v in pairs]
    db, values = backend._db, backend.values

    def body(w, part) -> list[bool]:
        done = []
        for key, expected in part:
            if not fits(key):
                done.append(False)
                continue
            value = w.txn.get(key, db=w.tables.blocks)
            if value is None and (record := w.txn.get(key, db=w.tables.places)) is not None:
                value = values.read(unpack_place(record))  # (None: its segment lost it)
            same = value is not None and len(value) == len(expected) and memoryview(value) == expected
            done.append(same and delete_entry(w.tables, w, key))
        return done

    if not items:
        return []
    parts: list[list[bool]] = []
    try:
        write_in_parts(db, backend._writes.reserve, items, parts, "delete", body)
    finally:  # (a split delete that fails part way has deleted the first parts: counted)
        backend._count(deletes=sum(map(sum, parts)))
    return [d for part in parts for d in part]
