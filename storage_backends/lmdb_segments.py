"""The LMDB tier's segment files: large values are appended to files beside the environment and
LMDB keeps only where they lie (a :class:`Place`), so writers copy each value once, in parallel,
with the GIL released, instead of through LMDB's single writer and its dirty pages.

``DIR/segments/<id as 16 hex>.seg``. A segment is append-only: an offset is never written twice,
so a reader holding a place reads the value that was committed there or (once the segment is
gone) nothing, never another value. Each writer appends to a segment of its own (a lane of its
process: :meth:`SegmentFiles.appending`), registered in the ``segments`` table before the file
exists (a file without a record is an orphan); the table counts each segment's live bytes and
entries, and a sealed segment with none left is deleted after the transaction that emptied it
commits. A value is written before the transaction that records its place: a crash leaves
unreferenced bytes, never a place over bytes never written (with ``sync``, the data is fsync'd
before that commit; a segment whose fsync failed is never trusted again:
:mod:`storage_backends.segment_sync`). Stored blocks check themselves (their header and body
checksums); this module checks that a place lies inside its file.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from storage_backends.log_throttle import LogThrottle
from storage_backends.segment_fds import Descriptors
from storage_backends.segment_io import SegmentWriter, read_fully
from storage_backends.segment_owners import LOCKING, Claims, pid_namespace, process_start
from storage_backends.segment_sync import SegmentSync
from tiered_kv.errors import BackendUnavailable

log = logging.getLogger(__name__)

DIRNAME = "segments"
SUFFIX = ".seg"
PLACE = struct.Struct("<QQQ")  # segment id, offset, length
SEGMENT = struct.Struct("<QQQQQQB")  # live bytes, live entries, end, owner pid, start, pid namespace, sealed
DAMAGED = {errno.EIO, errno.EUCLEAN, errno.EBADMSG}  # a read's errors that say the file is damaged
SEGMENT_ID = struct.Struct(">Q")  # the segments table's keys (and segment_keys' prefix)
CHECKED_LENGTH = 64 << 20  # a place longer than this is checked against its file before a buffer is made


class Place(NamedTuple):
    """Where a value lies: segment id, offset, length."""

    segment: int
    offset: int
    length: int

    def pack(self) -> bytes:
        return PLACE.pack(*self)


def unpack_place(record) -> Place:
    return Place(*PLACE.unpack_from(record))


def within(place: Place, end: int | None) -> bool:
    """Whether ``place`` lies inside the first ``end`` bytes of its segment (its file's size, or its
    record's end; None: no such segment): the one bounds check of a place."""
    return end is not None and place.offset + place.length <= end


class SegmentRecord(NamedTuple):
    """A segment's row in the ``segments`` table."""

    live_bytes: int
    live_entries: int
    end: int  # bytes appended to it as far as committed transactions know
    owner_pid: int  # the process appending to it (0 once sealed)
    owner_start: int  # that process's start time (clock ticks after boot): pids are reused
    sealed: bool  # no process appends to it any more
    owner_ns: int = 0  # the inode of its pid namespace (a container's pids mean nothing outside it)

    def pack(self) -> bytes:
        return SEGMENT.pack(max(0, self.live_bytes), max(0, self.live_entries), self.end,
                            self.owner_pid, self.owner_start, self.owner_ns, int(self.sealed))


def unpack_segment(record) -> SegmentRecord:
    live, entries, end, pid, start, ns, sealed = SEGMENT.unpack_from(record)
    return SegmentRecord(live, entries, end, pid, start, bool(sealed), ns)


def segment_key(segment: int) -> bytes:
    return SEGMENT_ID.pack(segment)


class Lane:
    """One writer's way into the segment files: the segment it appends to (None before its
    first append) and that segment's next free offset. Held by one writer at a time."""

    __slots__ = ("segment", "next")

    def __init__(self) -> None:
        self.segment: int | None = None
        self.next = 0


class SegmentFiles:
    """The segment files of one environment directory, as this process uses them: appends to
    its own open segments, one per lane (``appending``, ``reserve`` then ``write_many``), reads
    through cached descriptors, fsyncs what it wrote, deletes drained segments."""

    def __init__(self, path: Path, segment_bytes: int, writeback: str = "later",
                 direct_io: bool = False) -> None:
        self.dir = path / DIRNAME
        self.segment_bytes = segment_bytes
        self.pid = os.getpid()
        self.start = process_start(self.pid) or 0
        self._lock = threading.Lock()  # the lanes, reservations
        self._rolling = threading.Lock()  # taken (before _lock) to open a new segment
        self._closed = False
        self.fds = Descriptors(self.path_of)
        self.claims = Claims()  # the locks on the segments this process appends to (segment_owners)
        self.writer = SegmentWriter(self.dir, self.fds, direct_io, writeback)
        self._failures = LogThrottle(log)
        self.syncs = SegmentSync(self.dir, self.fds, self._retire)  # what awaits an fsync, what failed one
        self._lanes: list[Lane] = []  # every lane of this process (a writer's open segment)
        self._idle: list[Lane] = []  # the lanes no writer holds now
        self._pending: dict[int, int] = {}  # segment -> values reserved, not yet settled
        self._retired: dict[int, int] = {}  # segments this process stopped appending to -> end

    def path_of(self, segment: int) -> Path:
        return self.dir / f"{segment:016x}{SUFFIX}"

    def files(self) -> dict[int, Path]:
        """Every segment file in the directory, by id (names that are no segment's are ignored)."""
        found = {}
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return {}
        for name in names:
            stem = name[: -len(SUFFIX)]
            if name.endswith(SUFFIX) and len(stem) == 16:
                try:
                    found[int(stem, 16)] = self.dir / name
                except ValueError:
                    continue
        return found

    def file_size(self, segment: int) -> int | None:
        try:
            return os.stat(self.path_of(segment)).st_size
        except FileNotFoundError:
            return None

    def plausible(self, place: Place) -> bool:
        """Whether a buffer of ``place``'s length may be made to read it: a damaged place naming
        terabytes raised ENOMEM there (one longer than ``CHECKED_LENGTH`` must lie in its file)."""
        return place.length <= CHECKED_LENGTH or within(place, self.file_size(place.segment))

    # -- appending -----------------------------------------------------------------------------
    def new_record(self) -> SegmentRecord:
        """The record a segment this process opens starts with."""
        return SegmentRecord(0, 0, 0, self.pid, self.start, False, pid_namespace() | LOCKING)

    @contextmanager
    def appending(self):
        """A lane of this process for one writer's appends, from :meth:`reserve` to its last
        write: writers at once append to segments of their own. The kernel takes one file's
        lock for each buffered write to it, so two threads appending to one file wait for each
        other (this VM, 2 threads of 2 MiB writes into fresh page cache: 4.2 GB/s to one file,
        8.5 to a file each)."""
        with self._lock:
            lane = self._idle.pop() if self._idle else None
            if lane is None:
                lane = Lane()
                self._lanes.append(lane)
        segment = lane.segment  # (read once: a flush on another thread may retire it meanwhile)
        if segment is not None and self.fds.deleted(segment):  # (behind our back)
            self._retire({segment})  # start another: the next reserve opens one
        try:
            yield lane
        finally:
            with self._lock:
                self._idle.append(lane)

    def open_segments(self) -> list[int]:
        """The segments this process's lanes append to now."""
        with self._lock:
            return [lane.segment for lane in self._lanes if lane.segment is not None]

    def reserve(self, lane: Lane, length: int, register) -> tuple[int, int]:
        """(segment, offset) of ``length`` fresh bytes in ``lane``'s open segment (a lane held
        through :meth:`appending`); a new segment is opened first when there is none or it is
        full: ``register(segment_id)`` records it (a write transaction) before its file is
        created. Every reservation is :meth:`settle`-d once its transaction ended. OSError when
        there is no room, or in a fork's child (its parent appends at the same offsets)."""
        if os.getpid() != self.pid:
            raise OSError(errno.EBADF, f"segment files of process {self.pid}, not this one (a fork's child)")
        with self._lock:
            if not self._needs_new(lane, length):
                return self._take(lane, length)
        # a new segment, registered outside the lock (that waits for LMDB's writer and the remap
        # gate; a close holds the gate), one at a time
        with self._rolling:
            segment = int.from_bytes(os.urandom(8), "little") or 1
            register(segment)
            try:
                self.dir.mkdir(exist_ok=True)
                self.fds.create(segment)
                self.claims.take(segment, self.path_of(segment))  # (locked before its first write)
                with self._lock:
                    if self._closed:
                        raise OSError(errno.EBADF, "segment files closed")
                    if lane.segment is not None:
                        self._retired[lane.segment] = lane.next
                    lane.segment, lane.next = segment, 0
                    return self._take(lane, length)
            except BaseException:  # (ENOSPC, EMFILE) registered but never appended to: the next
                with self._lock:  # settle seals it and it goes (its record stayed for the
                    self._retired[segment] = 0  # process's life: one more with each refused put)
                raise

    def _needs_new(self, lane: Lane, length: int) -> bool:
        if self._closed:
            raise OSError(errno.EBADF, "segment files closed")
        end = self.writer.start(lane.next, length) + self.writer.stride(length)
        return lane.segment is None or (end > self.segment_bytes and lane.next > 0)

    def _take(self, lane: Lane, length: int) -> tuple[int, int]:
        offset = self.writer.start(lane.next, length)
        lane.next = offset + self.writer.stride(length)
        self._pending[lane.segment] = self._pending.get(lane.segment, 0) + 1
        return lane.segment, offset

    def settle(self, segments) -> dict[int, int]:
        """One reservation in each of ``segments`` ended (its value recorded or given up); the
        retired segments left with none in flight, with their ends: they may be sealed now."""
        with self._lock:
            for segment in segments:
                self._pending[segment] -= 1
                if not self._pending[segment]:
                    del self._pending[segment]
            done = {s: end for s, end in self._retired.items() if s not in self._pending}
            for segment in done:
                del self._retired[segment]
            return done

    def _retire(self, segments: set[int]) -> None:
        """No lane appends to ``segments`` any more (sealed once their reservations settled)."""
        with self._lock:
            for lane in self._lanes:
                if lane.segment in segments:
                    self._retired[lane.segment] = lane.next
                    lane.segment, lane.next = None, 0

    def retire_open(self) -> dict[int, int]:
        """Stop appending (closing): the segments that may be sealed now, with their ends."""
        with self._lock:
            for lane in self._lanes:
                if lane.segment is not None:
                    self._retired[lane.segment] = lane.next
                    lane.segment, lane.next = None, 0
            done = {s: end for s, end in self._retired.items() if s not in self._pending}
            for segment in done:
                del self._retired[segment]
            return done

    def write_many(self, segment: int, items: list[tuple[int, object]]) -> None:
        """Write values reserved one after the other in ``segment`` (``(offset, value)``) with
        one gathered write (:meth:`SegmentWriter.write_many`)."""
        self.writer.write_many(segment, items)
        self.syncs.wrote(segment)

    def sync(self, segments=None) -> None:
        """fsync every segment this process wrote to since the last sync; returns once every
        write before the call is durable (a sync running in another thread included). OSError
        when one of ``segments`` (None: any this call fsyncs) cannot be trusted to be durable
        (:meth:`SegmentSync.sync`)."""
        self.syncs.sync(segments)

    # -- reading -------------------------------------------------------------------------------
    def read_into(self, place: Place, buffer) -> bool:
        """Read the value at ``place`` into ``buffer`` (at least its length); False when its
        segment is gone or does not hold that many bytes there."""
        return self.read_at(place.segment, place.offset, [memoryview(buffer).cast("B")[: place.length]])

    def read_at(self, segment: int, offset: int, views: list[memoryview]) -> bool:
        """Fill byte views ``views`` in turn from ``offset`` of ``segment`` (one gathered read
        for values lying one after the other); False when the segment is gone, ends first or
        cannot be read (a miss)."""
        try:
            return self.read_range(segment, offset, views) is True
        except BackendUnavailable as exc:
            self.unavailable(exc)
            return False

    def unavailable(self, exc: BackendUnavailable) -> None:
        """Log (throttled) a segment that could not be opened or read for want of a resource."""
        self._failures.warning("%s", exc)

    def read_range(self, segment: int, offset: int, views: list[memoryview], fd: int | None = None) -> bool | None:
        """:meth:`read_at`, telling what went wrong: None when the segment is gone, False when
        it ends first or the disk cannot read it there (the value is damaged); BackendUnavailable
        when it cannot be opened or read for another reason (no descriptor left, closing).
        Through ``fd`` when the caller holds the segment's descriptor."""
        own = fd is None
        try:
            if own:
                fd = self.fds.hold(segment)
        except FileNotFoundError:
            return None  # gone: a miss
        except OSError as exc:
            raise BackendUnavailable(f"segment {self.path_of(segment)} cannot be opened: {exc}") from exc
        try:
            if not read_fully(fd, views, offset):
                return False
        except OSError as exc:
            if exc.errno not in DAMAGED:
                raise BackendUnavailable(f"segment {self.path_of(segment)} cannot be read: {exc}") from exc
            self._failures.warning("segment %s unreadable: %s", self.path_of(segment), exc)
            return False
        finally:
            if own:
                self.fds.release(segment)
        return True

    # -- the end of segments -------------------------------------------------------------------
    def delete(self, segments) -> None:
        """Delete drained segments' files (after the transaction dropping their records)."""
        for segment in segments:
            self.syncs.forget(segment)
            self.fds.forget(segment)
            self.writer.forget(segment)
            try:
                os.unlink(self.path_of(segment))
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("segment %s could not be deleted: %s", self.path_of(segment), exc)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for lane in self._lanes:
                lane.segment = None
        self.writer.close()  # (its writeback thread uses the descriptors)
        self.fds.close()
        self.claims.close()

