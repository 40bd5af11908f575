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
from storage_backends.lmdb_diskfull import Reserve, disk_is_full
from storage_backends.lmdb_entries import delete_entry, evict_oldest, put_entry
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
            again = [j for j, place in enumerate(places) if place is None]
            # (room for a segment value on disk: only a segment file deleted, once all its values are gone)
            if again and self._evict_for_disk(max(2 * sum(batch[large[j]][2] for j in again),
                                                  self.values.files.segment_bytes)):
                for j, place in zip(again, self.values.write([batch[large[j]][1] for j in again])):
                    places[j] = place
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

    def _put_batch(self, batch: list[tuple[bytes, object, int]], tenant: bytes, again: bool = True) -> list[bool]:
        nbytes = sum(n for _, _, n in batch)
        try:  # (w.tables: a read-only open's first write creates the missing tables)
            with self.db.guard("put"):
                stored = self.db.write(lambda w: [put_entry(w.tables, w, *item, tenant, self.eviction, self.pinned)
                                                   for item in batch], nbytes=nbytes)
            self.reserve.ensure()  # (a put found room: the reserve a full disk gave up is taken back)
            return stored
        except NoSpace as exc:
            # (pages the eviction frees go to LMDB's free list, never back to the disk: reused by later commits)
            if again and self._evict_for_disk(max(2 * nbytes, self.db.batch_bytes)):
                return self._put_batch(batch, tenant, again=False)
            log.warning("lmdb tier at %s: %d values refused: %s", self.db.path, len(batch), exc)
            self._count(put_rejected=len(batch))
            return [False] * len(batch)

    def _evict_for_disk(self, nbytes: int) -> bool:
        """A put found the disk full before the capacity was reached: the first entries to go that
        hold ``nbytes`` are evicted, as a full capacity would evict; whether any went (the put is
        tried once more). The eviction's commit copies pages too: the reserve is given up for it
        only when it found no room without (what is left of the reserve stays for deletes: an
        inline store never gets disk room back). Bounded: what it frees on disk depends on where
        the values lie (the callers' notes), so a put that still finds no room is refused, never
        evicting the whole store. A tool's open (no capacity) evicts nothing."""
        if self.eviction.capacity is None or not disk_is_full(self.db.path):
            return False  # (the map, not the disk: the environment made what room it could)
        try:
            with self.db.guard("evict"):  # (two commits: LMDB reuses the pages a commit frees only
                # from the second commit after it on, so the put's retry gets the first half's)
                evicted = sum(self.db.write(lambda w: evict_oldest(w.tables, w, nbytes // 2, self.eviction,
                                                                   self.pinned)) for _ in range(2))
        except NoSpace as exc:
            if self.reserve.release():
                return self._evict_for_disk(nbytes)
            log.warning("lmdb tier at %s: disk full, no room to evict: %s", self.db.path, exc)
            return False
        log.info("lmdb tier at %s: disk full before the capacity: %d entries evicted", self.db.path, evicted)
        return evicted > 0

    def delete_many(self, keys: Sequence[bytes]) -> int:
        keys = [k for k in map(as_key, keys) if fits(k)]
        if not keys:
            return 0
        done: list[int] = []
        try:
            write_in_parts(self.db, self.reserve, keys, done, "delete",
                           lambda w, part: sum(delete_entry(self.db.tables, w, k) for k in part))
        finally:  # (a split delete that fails part way has deleted the rest: counted)
            self._count(deletes=sum(done))
        return sum(done)



def write_in_parts(db: LmdbEnvironment, reserve: Reserve, items: list, results: list, what: str,
                   body: Callable[[object, list], object]) -> None:
    """``body(w, items)`` in one write transaction, its result appended to ``results``; on a full
    disk the reserve given up and the same again, then halves in turn, each part's result
    appended in order: a delete's copied pages need room the disk may not have for all at once,
    and the first half's commit frees pages for the rest (else a store that filled its disk could
    never delete, nor write again). BackendUnavailable when a single item finds no room."""
    try:
        with db.guard(what):
            results.append(db.write(lambda w: body(w, items)))
            return
    except NoSpace as exc:
        if reserve.release():  # the room held for this: the same again
            return write_in_parts(db, reserve, items, results, what, body)
        if len(items) == 1:
            raise BackendUnavailable(f"lmdb store at {db.path} is full: {exc}") from None
    half = len(items) // 2
    write_in_parts(db, reserve, items[:half], results, what, body)
    write_in_parts(db, reserve, items[half:], results, what, body)
