"""Large values of the LMDB tier in segment files (:mod:`storage_backends.lmdb_segments`): the
write of each value before the transaction that records its place, the sealing of segments
this process stopped appending to, reads into reused per-thread buffers, and the recovery of
segments left by processes that died, and the withdrawal of the entries recorded in segments
whose fsync failed (:mod:`storage_backends.segment_sync`: their bytes may never reach the disk).
Handed the environment and the segment files."""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Sequence
from contextlib import contextmanager

import lmdb

from storage_backends.gathered import nbytes_of
from storage_backends.lmdb_entries import withdraw_segments
from storage_backends.lmdb_environment import LmdbEnvironment, NoSpace
from storage_backends.lmdb_places import keys_in, recover_segments, register_segment, seal_segments
from storage_backends.lmdb_segments import Lane, Place, SegmentFiles, unpack_place
from storage_backends.log_throttle import LogThrottle
from storage_backends.segment_fds import being_deleted, lock_for_deletion
from storage_backends.segment_io import VALUE_END_ALIGN
from storage_backends.segment_owners import close_copies, forget_in_children
from storage_backends.segment_runs import runs
from tiered_kv.errors import BackendClosed, BackendError, BackendUnavailable

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 30.0  # how long closing waits for running puts before sealing what it can
PAGE = 4096  # reads land in a buffer at their file offset's place within a page: the kernel's
# copy out of the page cache runs at a quarter to three quarters of its pace on some CPUs (AMD
# EPYC here) unless destination and source sit a multiple of 32 bytes apart
# (tools/probe_vm_memory.py)
MAX_GAP = PAGE  # read_split_run: the most bytes between two values of a run (a direct value's pad)
RUN_SLOT = 1  # the thread buffer holding a run's heads (whole values are read into buffer 0)


class SegmentValues:
    """Values of at least ``min_bytes`` go to ``files``; smaller ones stay in LMDB's pages. The
    files of segments a transaction drains are deleted once it commits (``db.on_drained``), but
    for those another process is deleting (:func:`~storage_backends.segment_fds.being_deleted`:
    a compaction holds a victim until its swap is durable: :meth:`hold_for_deletion`)."""

    def __init__(self, db: LmdbEnvironment, files: SegmentFiles, min_bytes: int, sync: bool) -> None:
        self.db, self.files, self.min_bytes, self.sync = db, files, min_bytes, sync
        db.on_drained = self._drained
        db.on_draining = self._draining
        self._deleting: dict[int, int] = {}  # segments this process holds for deletion -> their lock
        self._unsealed: dict[int, int] = {}  # segments whose seal failed (a full disk) -> end: tried again
        self._sealing = threading.Lock()  # _unsealed, _deleting
        self._writers = threading.Condition()
        self._inflight = 0  # puts (and compactions) between their first write and their settling
        self._closing = False
        self._local = threading.local()
        self._gap = memoryview(bytearray(MAX_GAP))  # where the bytes between values of a run go
        self._failures = LogThrottle(log)
        forget_in_children(self)

    @contextmanager
    def writing(self):
        """Held by a put from its first write to its settling: closing waits for it, and
        refuses new ones (BackendClosed)."""
        with self._writers:
            if self._closing:
                raise BackendClosed(f"lmdb backend at {self.db.path} is closing")
            self._inflight += 1
        try:
            yield
        finally:
            with self._writers:
                self._inflight -= 1
                self._writers.notify_all()

    def wanted(self, nbytes: int) -> bool:
        return nbytes >= self.min_bytes

    # -- writes --------------------------------------------------------------------------------
    def write(self, values: Sequence) -> list[Place | None]:
        """Append each value to a segment of this writer's own; its place, or None when it could
        not be written (no room on the disk, an I/O error: logged, counted by the caller). Every
        place (and None) must be :meth:`settle`-d once its transaction ended. With ``sync`` the
        values are :meth:`durable` before the commit that names them."""
        places: list[Place | None] = []
        try:
            self._write_all(values, places)
        except BaseException:
            self.settle(places)  # (BackendClosed, a bug): nothing of this call is recorded
            raise
        return self.durable(places) if self.sync else places

    def durable(self, places: list[Place | None]) -> list[Place | None]:
        """fsync the values :meth:`write` put at ``places`` (before the commit that names them);
        all None (settled here) when an fsync failed: nothing of them may be recorded."""
        if not any(p is not None for p in places):
            return places
        try:  # (its own segments' data: a failed fsync of another writer's segment does not fail this put)
            self.files.sync({p.segment for p in places if p is not None})
        except OSError as exc:
            self._failures.warning("lmdb tier at %s: segment fsync failed: %s", self.db.path, exc)
            self.settle(places)
            self._after_failure()
            return [None] * len(places)
        return places

    def _write_all(self, values: Sequence, places: list[Place | None]) -> None:
        """Reserve every value's place in this writer's lane (``places``, in order), then write
        the values reserved one after the other a run at a time
        (:mod:`storage_backends.segment_runs`); the places of values not written are settled
        and become None."""
        with self.files.appending() as lane:  # a segment of this writer's own
            for value in values:
                places.append(self._reserve(lane, value))
            for run in runs(places, VALUE_END_ALIGN):
                if places[run[0]] is None:  # (not reserved: a group of its own)
                    continue
                try:
                    self.files.write_many(places[run[0]].segment, [(places[i].offset, values[i]) for i in run])
                except OSError as exc:
                    self._failures.warning("lmdb tier at %s: segment write failed: %s", self.db.path, exc)
                    refused = [places[i] for i in run]
                    for i in run:  # (first: these are settled once, here)
                        places[i] = None
                    self.settle(refused)

    def _reserve(self, lane: Lane, value) -> Place | None:
        nbytes = nbytes_of(value)
        try:
            segment, offset = self.files.reserve(lane, nbytes, self._register)
        except (OSError, NoSpace, BackendUnavailable) as exc:
            self._failures.warning("lmdb tier at %s: no segment to write to: %s", self.db.path, exc)
            return None
        return Place(segment, offset, nbytes)

    def _register(self, segment: int) -> None:
        record = self.files.new_record()
        self.db.write(lambda w: register_segment(self.db.tables, w, segment, record))

    def settle(self, places: Sequence[Place | None]) -> None:
        """The transactions recording ``places`` ended: seal the segments left with none in
        flight (and those whose seal failed before). Never raises: a seal the disk refuses is
        logged and tried again by the next settle (their puts are done)."""
        done = self.files.settle([p.segment for p in places if p is not None])
        with self._sealing:
            done, self._unsealed = {**self._unsealed, **done}, {}
        if not done:
            return
        try:
            self.seal(done)
        except (NoSpace, lmdb.Error, BackendError) as exc:
            with self._sealing:
                self._unsealed = {**done, **self._unsealed}
            self._failures.warning("lmdb tier at %s: %d segments not sealed yet: %s", self.db.path, len(done), exc)

    def seal(self, ends: dict[int, int]) -> None:
        """Seal segments (id -> end); the environment deletes the drained ones' files. Their
        locks go first: should the seal fail, another writer's recovery seals them."""
        self.files.claims.drop(ends)
        self.db.write(lambda w: seal_segments(self.db.tables, w, ends))

    def hold_for_deletion(self, segment: int) -> None:
        """Lock ``segment``'s file (:func:`~storage_backends.segment_fds.lock_for_deletion`) until
        :meth:`let_go`: taken before the commit that drains it, so no check takes it for an
        orphan and no other process deletes it until this one does (it goes through
        ``db.on_drained`` all the same)."""
        with self._sealing:
            if segment in self._deleting:
                return
            fd = lock_for_deletion(self.files.path_of(segment))
            if fd is not None:
                self._deleting[segment] = fd

    def forget_in_child(self) -> None:
        """In a child forked from this process: close its copies of the deletion locks (kept, a
        child outliving a compaction killed mid-deletion kept the victim's file for good)."""
        fds, self._deleting, self._sealing = list(self._deleting.values()), {}, threading.Lock()
        close_copies(fds)

    def let_go(self, segments) -> None:
        with self._sealing:
            fds = [self._deleting.pop(s) for s in segments if s in self._deleting]
        for fd in fds:
            os.close(fd)

    def _draining(self, segments: list[int], committing: bool) -> None:
        """``db.on_draining``: hold the segments a transaction drops for deletion before it
        commits (till their files go no other process's check takes one for an orphan); let
        go when it did not commit."""
        if not committing:
            return self.let_go(segments)
        for segment in segments:
            self.hold_for_deletion(segment)

    def _drained(self, segments: list[int]) -> None:
        """``db.on_drained``: delete the files of drained segments, but those another process
        holds for deletion (it deletes them once its commit is durable)."""
        with self._sealing:
            own = set(self._deleting)
        self.files.delete([s for s in segments if s in own or not being_deleted(self.files.path_of(s))])
        self.let_go(segments)

    # -- reads ---------------------------------------------------------------------------------
    def place_of(self, txn, key: bytes) -> Place | None:
        record = txn.get(key, db=self.db.tables.places)
        return unpack_place(record) if record is not None else None

    def read(self, place: Place, slot: int = 0) -> memoryview | None:
        """The value at ``place`` in this thread's buffer number ``slot`` (valid until the
        thread reads into that buffer again); None when its segment no longer holds it."""
        if not self.files.plausible(place):
            return None
        view = self._buffer(slot, place.length, place.offset % PAGE)
        return view.toreadonly() if self.files.read_into(place, view) else None

    def read_split(self, place: Place, out, max_head: int, read_at):
        """Read the value at ``place`` as a head (into this thread's buffer) and its last
        ``len(out)`` bytes straight into ``out``: the head, None when the value does not
        :func:`split` (read it whole), False when its segment no longer holds it."""
        if not splits(place, out, max_head):
            return None
        heads = self.read_split_run([place], [out], read_at)
        return False if heads is None else heads[0]

    def read_split_run(self, places: Sequence[Place], outs: Sequence, read_at) -> list[memoryview] | None:
        """Values lying one after the other in one segment (gaps of under ``MAX_GAP`` bytes),
        each longer than its ``outs[i]``, read with one gathered read: each one's head into
        this thread's buffer ``RUN_SLOT`` and its rest straight into its out. The heads (valid
        until the thread reads another run), or None when the run could not be read whole (a
        segment gone or cut short): the caller reads its values one at a time. ``read_at``
        (:meth:`SegmentFiles.read_at`'s arguments and answer) reads, through a visit's held
        descriptors."""
        dsts = [memoryview(o).cast("B") for o in outs]
        heads_len = [place.length - len(dst) for place, dst in zip(places, dsts)]
        room = self._buffer(RUN_SLOT, sum(heads_len))
        views: list[memoryview] = []
        heads: list[memoryview] = []
        at, end = 0, places[0].offset
        for place, dst, n in zip(places, dsts, heads_len):
            if not 0 <= place.offset - end < MAX_GAP or n <= 0:
                raise ValueError(f"not a run of values: {place} after {end}")
            if place.offset > end:
                views.append(self._gap[: place.offset - end])
            heads.append(room[at : at + n])
            views += [heads[-1], dst]
            at, end = at + n, place.offset + place.length
        if not read_at(places[0].segment, places[0].offset, views):
            return None
        return [head.toreadonly() for head in heads]

    def _buffer(self, slot: int, length: int, phase: int = 0) -> memoryview:
        """``length`` bytes of this thread's buffer ``slot``, starting ``phase`` bytes into a
        page (page-aligned anonymous memory, grown as needed, never shrunk)."""
        buffers = getattr(self._local, "buffers", None)
        if buffers is None:
            buffers = self._local.buffers = []
        while len(buffers) <= slot:
            buffers.append(mmap.mmap(-1, PAGE))
        if len(buffers[slot]) < phase + length:
            buffers[slot] = mmap.mmap(-1, max(PAGE + length, 2 * len(buffers[slot])))
        return memoryview(buffers[slot])[phase : phase + length]

    # -- the whole environment -----------------------------------------------------------------
    def recover(self) -> None:
        """Seal dead processes' segments and delete orphan files (at open, writers only; on a
        full disk left to the compactor's next look)."""
        try:
            sealed, orphans = self.db.write(lambda w: recover_segments(self.db.tables, w, self.files))
        except NoSpace as exc:
            log.warning("lmdb tier at %s: what processes that are gone left not looked at: %s", self.db.path, exc)
            return
        if sealed or orphans:
            log.info("lmdb tier at %s: sealed %d segments of processes that are gone, deleted %d orphan "
                     "segment files", self.db.path, sealed, orphans)

    def flush(self) -> None:
        """fsync what this process wrote, and withdraw the entries recorded in segments whose
        fsync failed: OSError when an fsync of this flush failed, BackendUnavailable when those
        entries could not be withdrawn (either way, not every committed put is durable)."""
        try:
            self.files.sync()
        except OSError:
            self._after_failure()
            raise
        try:
            self.withdraw()
        except NoSpace as exc:
            raise BackendUnavailable(f"lmdb store at {self.db.path}: entries not withdrawn: {exc}") from exc

    def flush_at_close(self) -> None:
        """A clean close's last word before the index's sync (no transaction to come): what was
        stored is durable after close, so the places the index names must lie over bytes on the
        disk. fsync only what this process wrote (a reader fsyncs nothing); logged, never raised."""
        try:
            self.flush()
        except (OSError, lmdb.Error, BackendError) as exc:  # (a segment poisoned: its entries withdrawn)
            log.warning("lmdb tier at %s: closing with segment values not durable: %s", self.db.path, exc)

    def withdraw(self) -> None:
        """Delete the entries recorded in segments whose fsync failed (counted as
        ``sync_failed_entries``, logged): a later fsync of them proves nothing."""
        poisoned = self.files.syncs.poisoned()
        if not poisoned:
            return
        with self.db.txn() as txn:  # (a write transaction only when there is something to withdraw)
            if all(next(keys_in(self.db.tables, txn, s), None) is None for s in poisoned):
                return
        withdrawn = self.db.write(lambda w: withdraw_segments(self.db.tables, w, poisoned))
        for segment, n in withdrawn.items():
            log.warning("lmdb tier at %s: fsync of segment %016x failed: its %d entries are withdrawn "
                        "(their bytes may never reach the disk)", self.db.path, segment, n)

    def _after_failure(self) -> None:
        """An fsync failed: seal the segments it retired that have no value in flight, and
        withdraw what they hold (when that fails too, logged: the next flush tries again)."""
        try:
            self.settle([])
            self.withdraw()
        except Exception as exc:
            self._failures.warning("lmdb tier at %s: entries of a segment whose fsync failed not withdrawn "
                                   "yet: %s", self.db.path, exc)

    def seal_own(self) -> None:
        """Closing: refuse new puts, wait for those running, seal this process's segments."""
        with self._writers:
            self._closing = True
            if not self._writers.wait_for(lambda: not self._inflight, CLOSE_WAIT_S):
                log.warning("lmdb tier at %s: closing while %d puts still run", self.db.path, self._inflight)
        with self._sealing:  # (with those whose seal failed before)
            done, self._unsealed = {**self._unsealed, **self.files.retire_open()}, {}
        if done:
            try:
                self.seal(done)
            except Exception as exc:  # the next writer's recovery seals them
                log.warning("lmdb tier at %s: segments not sealed at close: %s", self.db.path, exc)


def splits(place: Place, out, max_head: int) -> bool:
    """Whether the value at ``place`` is read in two pieces with ``out``: it is longer than
    ``out`` by 1..``max_head`` bytes (its head), and the rest goes straight into ``out``."""
    return 0 < place.length - nbytes_of(out) <= max_head
