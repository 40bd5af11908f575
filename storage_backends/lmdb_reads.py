"""Reads of the LMDB tier: values in LMDB's pages are visited there (zero-copy, inside one read
transaction); values in segment files are read into this thread's buffers, in two pieces with the rest
straight into the reader's own buffer (:meth:`LmdbReads.visit_split`), or part by part
(:meth:`LmdbReads.visit_ranges`). Every read
is buffered as an access (recorded with the next write) and counted."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from storage_backends.base import Visitor
from storage_backends.gathered import nbytes_of
from storage_backends.lmdb_environment import LmdbEnvironment
from storage_backends.lmdb_ranges import SegmentRanges
from storage_backends.lmdb_segments import Place
from storage_backends.lmdb_tables import as_key, fits
from storage_backends.lmdb_values import MAX_GAP, SegmentValues, splits
from storage_backends.segment_runs import runs

MAX_SPLIT_HEAD = 64 << 10  # visit_split: the most bytes read ahead of a value's part that goes to its out
UNREAD = object()  # _visit_split_one: the value's head is not read yet


class LmdbReads:
    """Handed the environment, the segment values and the backend's counters."""

    def __init__(self, db: LmdbEnvironment, values: SegmentValues, count: Callable[..., None]) -> None:
        self.db, self.values, self._count = db, values, count

    def visit_many(self, keys: Sequence[bytes], visitor: Visitor) -> list[bool]:
        """Zero-copy for small values: ``visitor`` sees LMDB's own pages, inside one read
        transaction; a value in a segment is read into a buffer of this thread first."""
        keys = [as_key(k) for k in keys]
        sizes: list[int | None] = [None] * len(keys)
        with self.db.guard("read"), self.db.txn() as txn:
            for i, key in enumerate(keys):
                value = self._value(txn, key)
                if value is not None:
                    sizes[i] = len(value)
                    visitor(i, value)
        return self._counted(keys, sizes)

    def visit_ranges(self, keys: Sequence[bytes], visitor) -> list[bool]:
        """``visitor(sizes, reader)`` inside one read transaction: ``reader`` reads parts of the
        values found (:class:`~storage_backends.lmdb_ranges.SegmentRanges`: ``preadv`` from
        their segment files, or a copy out of LMDB's pages), as a layer-wise reader asks for
        them (every block's first layer group, then the second, ...)."""
        keys = [as_key(k) for k in keys]
        with self.db.guard("read"), self.db.txn() as txn:
            ranges = SegmentRanges([self._locate(txn, k) for k in keys], self.values.files)
            try:
                visitor(list(ranges.sizes), ranges)
            finally:
                ranges.close()
        # a value whose segment turned out gone or cut short was not read: no hit, no access (the
        # answer is still presence as the visit began)
        self._counted(keys, [None if i in ranges.lost else n for i, n in enumerate(ranges.sizes)])
        return [n is not None for n in ranges.sizes]

    def visit_split(self, keys: Sequence[bytes], outs: Sequence[object], visitor) -> list[bool]:
        """Values in segment files longer than their ``outs[i]`` by at most ``MAX_SPLIT_HEAD``
        bytes are read in two pieces, the rest straight into ``outs[i]`` (one copy, made by the
        kernel); values in LMDB's pages are visited there, zero-copy. Such values lying one
        after the other in a segment (as a batch written by one writer does) are read a run at a
        time (:mod:`storage_backends.segment_runs`). The segments read from keep their
        descriptors held for the visit (:class:`~storage_backends.lmdb_ranges.SegmentRanges`)."""
        keys = [as_key(k) for k in keys]
        sizes: list[int | None] = [None] * len(keys)
        with self.db.guard("read"), self.db.txn() as txn:
            # (a value at least segment_min long lies in a segment: its place is asked first, one
            # lookup where there were two; measured level within this VM's noise, 64 KiB blocks)
            located = [self._locate(txn, key, self.values.wanted(nbytes_of(out))) for key, out in zip(keys, outs)]
            places = [place for _, place in located]
            ranges = SegmentRanges(located, self.values.files)
            try:
                for run in runs(places, MAX_GAP, lambda i: splits(places[i], outs[i], MAX_SPLIT_HEAD)):
                    for i, head in zip(run, self._heads(run, places, outs, ranges)):
                        self._visit_split_one(i, located[i][0], places[i], outs[i], visitor, sizes, head, ranges)
            finally:
                ranges.close()
        return self._counted(keys, sizes)

    def _heads(self, run: list[int], places: list[Place | None], outs: Sequence[object],
               ranges: SegmentRanges) -> list:
        """The heads of the values of ``run`` (a group of :func:`runs`), read with one gathered
        read when they split: per value its head, False when its segment no longer holds it,
        UNREAD for those of a longer run that could not be read whole (each is read on its
        own), None when it does not split (read whole)."""
        first = places[run[0]]
        if first is None or not splits(first, outs[run[0]], MAX_SPLIT_HEAD):
            return [None] * len(run)  # (a run of several splits: runs() asked)
        heads = self.values.read_split_run([places[i] for i in run], [outs[i] for i in run], ranges.read_at)
        if heads is None:
            return [UNREAD if len(run) > 1 else False] * len(run)
        return heads

    def _visit_split_one(self, i: int, value, place: Place | None, out, visitor, sizes: list[int | None],
                         head, ranges: SegmentRanges) -> None:
        """Visit the ``i``-th value: its head (read now when UNREAD) and ``out`` holding the
        rest, or the whole value; ``sizes[i]`` set when it was there."""
        if place is not None:
            if head is UNREAD:
                head = self.values.read_split(place, out, MAX_SPLIT_HEAD, ranges.read_at)
            if head is False:  # its segment no longer holds it: a miss
                return
            if head is not None and visitor(i, head, None) is not False:
                sizes[i] = place.length
                return
            value = self.values.read(place)  # not split, or not wanted split: the whole value
            if value is None:
                return
        if value is not None:
            visitor(i, None, value)
            sizes[i] = len(value)

    def _counted(self, keys: Sequence[bytes], sizes: Sequence[int | None]) -> list[bool]:
        """Record the reads of the keys found (``sizes[i]``: bytes read, None when absent; applied
        with the next write) and count the call; presence per key."""
        hits = [k for k, n in zip(keys, sizes) if n is not None]
        if hits:
            self.db.touch(hits, time.time_ns())
        self._count(gets=len(keys), hits=len(hits), bytes_out=sum([n for n in sizes if n is not None]))
        return [n is not None for n in sizes]

    def _locate(self, txn, key: bytes, segment_first: bool = False) -> tuple[memoryview | bytes | None, Place | None]:
        """Where ``key``'s value is: ``(LMDB's page, None)``, ``(None, its place in a segment)``,
        or ``(None, None)`` when absent; with ``segment_first`` the segments' places are asked
        first (a value of segment size: LMDB's pages hold one only when it was compressed smaller,
        or written by an older version)."""
        if not fits(key):
            return None, None
        if segment_first and (place := self.values.place_of(txn, key)) is not None:
            return None, place
        value = txn.get(key, db=self.db.tables.blocks)
        if value is not None or segment_first:
            return value, None
        return None, self.values.place_of(txn, key)

    def _value(self, txn, key: bytes):
        """``key``'s value: LMDB's page, or from its segment a copy in this thread's buffer;
        None when absent (or its segment no longer holds it)."""
        value, place = self._locate(txn, key)
        return value if place is None else self.values.read(place)
