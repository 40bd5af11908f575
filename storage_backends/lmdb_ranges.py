"""Reads of the LMDB tier's values during one visit: parts of them (:meth:`LmdbReads.visit_ranges`,
layer-wise loads), or whole values read in two pieces (:meth:`LmdbReads.visit_split`, through
:meth:`SegmentRanges.read_at`). A value in a segment file is read with ``preadv`` straight into
the reader's buffer, a value in LMDB's pages is copied out of the visit's read transaction.

A segment read from keeps its descriptor held until the visit ends (at most ``HOLD`` segments a
visit; reads of the others hold theirs per read; none once the process ran short of
descriptors lately), so a segment that compaction deletes mid-visit still reads: the visit's
transaction named its places. Nothing is mapped: a file cut
short, or a page the disk cannot read, makes a read come back short or fail (a damaged value),
where a memory map would kill the process with SIGBUS.
"""

from __future__ import annotations

from collections.abc import Iterable

from storage_backends.base import check_range
from storage_backends.lmdb_segments import Place, SegmentFiles
from storage_backends.segment_io import advise
from tiered_kv.errors import BackendUnavailable

HOLD = 8  # segments whose descriptors one visit keeps held (a visit spans a few: 128 MiB each)


class SegmentRanges:
    """:class:`~storage_backends.base.RangeReader` of one visit: ``located[i]`` is ``(LMDB's
    page, None)``, ``(None, place)`` or ``(None, None)`` for absent values. :meth:`close` when
    the visit ends."""

    def __init__(self, located: list[tuple[object, Place | None]], files: SegmentFiles) -> None:
        self.located, self.files = located, files
        self.sizes: list[int | None] = [
            len(value) if value is not None else place.length if place is not None else None
            for value, place in located]
        self.lost: set[int] = set()  # values a read found gone or damaged: not read, whatever sizes says
        self._held: dict[int, int] = {}  # segment -> descriptor held for this visit
        self._short = files.fds.short  # the process ran short of descriptors lately: hold none

    def advise(self, ranges: Iterable[tuple[int, int, int]]) -> None:
        for i, start, end in ranges:
            place = self.located[i][1]
            if place is None:
                continue  # (LMDB reads ahead in its own pages)
            start, end = max(0, start), min(end, place.length)
            if end <= start:
                continue  # (a length of 0 would advise the rest of the file)
            fd = self._fd(place.segment)
            if fd is not None:
                advise(fd, place.offset + start, end - start)

    def read(self, i: int, start: int, into) -> bool | None:
        value, place = self.located[i]
        dst = memoryview(into).cast("B")
        check_range(i, start, len(dst), self.sizes[i])
        if place is None:
            dst[:] = value[start : start + len(dst)]
            return True
        got = self._read_range(place.segment, place.offset + start, [dst])
        if got is not True:
            self.lost.add(i)
        return got

    def read_at(self, segment: int, offset: int, views: list[memoryview]) -> bool:
        """:meth:`SegmentFiles.read_at <storage_backends.lmdb_segments.SegmentFiles.read_at>`
        through the visit's held descriptor: False when the bytes could not be read whole (a
        miss; a segment that cannot be read for another reason is logged)."""
        try:
            return self._read_range(segment, offset, views) is True
        except BackendUnavailable as exc:
            self.files.unavailable(exc)
            return False

    def _read_range(self, segment: int, offset: int, views: list[memoryview]) -> bool | None:
        try:
            return self.files.read_range(segment, offset, views, self._fd(segment))
        except BackendUnavailable:
            if not self._held:
                raise
            # (no descriptor to be had, say: the process is short of them) this visit's own go,
            # and it holds none from now on; once more
            self.close()
            self._short = True
            return self.files.read_range(segment, offset, views)

    def _fd(self, segment: int) -> int | None:
        """The segment's descriptor held for the visit, or None (held per read: more than
        HOLD segments, a process short of descriptors, or none to be had now)."""
        fd = self._held.get(segment)
        if fd is None and len(self._held) < HOLD and not self._short:
            try:
                fd = self._held[segment] = self.files.fds.hold(segment)
            except FileNotFoundError:  # gone: the read says so
                return None
            except OSError:  # no descriptor to be had, say: the visit holds no more
                self._short = True
                return None
        return fd

    def close(self) -> None:
        held, self._held = self._held, {}
        for segment in held:
            self.files.fds.release(segment)
