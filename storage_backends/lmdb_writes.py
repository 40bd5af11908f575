"""Writes of the LMDB tier: values of at least ``segment_min`` bytes are written to segment files
first (:class:`storage_backends.lmdb_values.SegmentValues`), then every entry of a call is recorded
in one write transaction; smaller values go into LMDB's pages in transactions of about
``batch_bytes``. Evictions and quotas as :func:`storage_backends.lmdb_entries.put_entry` plans them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from storage_backends.eviction import Eviction
from storage_backends.gathered import joined, nbytes_of
from storage_backends.lmdb_compaction import Compactor
from storage_backends.lmdb_diskfull import Reserve
from storage_backends.lmdb_entries import delete_entry, put_entry
from storage_backends.lmdb_environment import LmdbEnvironment, NoSpace
from storage_backends.lmdb_tables import MAX_KEY, as_key, fits
from storage_backends.lmdb_values import SegmentValues
from storage_backends.quotas import as_tenant
from tiered_kv.errors import BackendUnavailable, InvalidKey

log = logging.getLogger(__name__)


class LmdbWrites:
    """Handed the environment, the segment values, the eviction policy, this process's pins and
    the backend's counters."""

    def __init__(self, db: LmdbEnvironment, values: SegmentValues, eviction: Eviction,
                 pinned: Callable[[], set[bytes]], count: Callable[..., None], compactor: Compactor) -> None:
        self.db, self.values, self.eviction, self.pinned, self._count = db, values, eviction, pinned, count
        self.compactor = compactor
        self.reserve = Reserve(db.path)  # (room for deletes on a disk the store filled)

    def put_many(self, items: Sequence[tuple[bytes, bytes]], tenant: bytes = b"") -> list[bool]:
        """Grouped into write transactions of about ``batch_bytes`` (one per large value)."""
        tenant = as_tenant(tenant)
        batch: list[tuple[bytes, object, int]] = []
        for key, value in items:
            key = as_key(key)
            if not fits(key):
                raise InvalidKey(f"lmdb keys must be 1..{MAX_KEY} bytes, got {len(key)}")
            n = nbytes_of(value)  # a value for LMDB's pages (not a segment's) must be one buffer
            batch.append((key, value if self.values.wanted(n) else joined(value), n))
        large = [i for i, (_, _, n) in enumerate(batch) if self.values.wanted(n)]
        if large:
            return self._put_placed(batch, large, tenant)
        return self._put_inline(batch, tenant)

    def _put_placed(self, batch: list[tuple[bytes, object, int]], large: list[int], tenant: bytes) -> list[bool]:
        """Large values written to segment files first, then every entry recorded in one
        transaction; a value that could not be written is refused. A close waits for it (from
        the first write to the settling), then seals what it left. The transactions registering
        and sealing segments fail as the put's own do (BackendUnavailable, counted)."""
        with self.values.writing(), self.db.guard("put"):
            self.db.check_open()
            places = self.values.write([batch[i][1] for i in large])
            for i, place in zip(large, places):
                batch[i] = (batch[i][0], place, batch[i][2])
            todo = [i for i, item in enumerate(batch) if item[1] is not None]
            stored = [False] * len(batch)
            try:
                for i, ok in zip(todo, self._put_batch([batch[i] for i in todo], tenant)):
                    stored[i] = ok
            finally:
                self.values.settle(places)
        self._count(put_rejected=len(batch) - len(todo))
        try:
            self.compactor.maybe_compact()
        except Exception as exc:  # the puts are done; the next one tries again
            log.warning("lmdb tier at %s: compaction failed: %s", self.db.path, exc)
        return stored

    def _put_inline(self, batch: list[tuple[bytes, object, int]], tenant: bytes) -> list[bool]:
        stored: list[bool] = []
        start, size = 0, 0
        for i, (_, _, n) in enumerate(batch):
            if i > start and size + n > self.db.batch_bytes:
                stored += self._put_batch(batch[start:i], tenant)
                start, size = i, 0
            size += n
        if start < len(batch):
            stored += self._put_batch(batch[start:], tenant)
        return stored

    def _put_batch(self, batch: list[tuple[bytes, object, int]], tenant: bytes) -> list[bool]:
        try:  # (w.tables: a read-only open's first write creates the missing tables)
            with self.db.guard("put"):
                stored = self.db.write(lambda w: [put_entry(w.tables, w, *item, tenant, self.eviction, self.pinned)
                                                   for item in batch], nbytes=sum(n for _, _, n in batch))
            self.reserve.ensure()  # (a put found room: the reserve a full disk gave up is taken back)
            return stored
        except NoSpace as exc:
            log.warning("lmdb tier at %s: %d values refused: %s", self.db.path, len(batch), exc)
            self._count(put_rejected=len(batch))
            return [False] * len(batch)

    def delete_many(self, keys: Sequence[bytes]) -> int:
        keys = [k for k in map(as_key, keys) if fits(k)]
        if not keys:
            return 0
        done = [0]
        try:
            self._delete(keys, done)
        finally:  # (a split delete that fails part way has deleted the rest: counted)
            self._count(deletes=done[0])
        return done[0]

    def _delete(self, keys: list[bytes], done: list[int]) -> None:
        """One transaction; on a full disk, halves of it in turn: a delete's copied pages need room
        the disk may not have for all at once, and the first half's commit frees pages for the rest
        (else a store that filled its disk could never delete, nor write again). ``done[0]``: keys
        deleted so far."""
        try:
            with self.db.guard("delete"):
                done[0] += self.db.write(lambda w: sum(delete_entry(self.db.tables, w, k) for k in keys))
                return
        except NoSpace as exc:
            if self.reserve.release():  # the room held for this: the same delete again
                return self._delete(keys, done)
            if len(keys) == 1:
                raise BackendUnavailable(f"lmdb store at {self.db.path} is full: {exc}") from None
        half = len(keys) // 2
        self._delete(keys[:half], done)
        self._delete(keys[half:], done)

