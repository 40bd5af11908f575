"""Compaction of the LMDB tier's segment files. Evicting or overwriting a value in a segment
leaves its bytes there until the whole segment drains; a segment held by a few long-lived
values (a shared prefix's first blocks) would keep the rest of its file forever. When the dead
bytes of sealed segments exceed ``dead_limit``, the live values of the sparsest sealed segment
(the one with the smallest live share) are copied to an open segment of this process (the
compacting writer's lane; fsync'd first) and their places swapped in one transaction, each
only if the value still lies where it was read (a value overwritten, deleted or moved by another
process meanwhile keeps its new place; the copy is dead bytes). The old segment then drains and
its file goes once that transaction is durable (without ``sync`` a crash could undo it, and the
values would be back in a file that is gone). Disk use stays within the capacity plus
``dead_limit`` plus the open segments.
A direct writer (``direct_io``) pads each value it writes to a whole page, so its copies take
pads again: its compaction counts each live value's pad (what its copy adds to reach a whole
page: none for a value of whole pages) as not reclaimable, else a store of values under a page
would be moved round and round without freeing anything. The pads are read from the values'
places, a few thousand per check (a segment not read yet counts a page less a byte per value:
an overstatement, which only delays its compaction; a flat one kept the dead bytes of
page-sized values over the limit for good). A victim none of whose values can be read is passed
over from then on (damage: ``check(fix)``); one whose copies the disk refused, or that was read while
the process ran short of descriptors, is tried again later.
Every ``RECOVER_EVERY_S`` a check also seals the open segments of processes that died (killed
mid-put or mid-compaction: only sealed segments are compacted or drained) and deletes the files no
record names (a process killed between the commit that drained a segment and its file's deletion),
as a writer's open does: else a process running on would keep them until a writer opens again."""

from __future__ import annotations

import logging
import threading
import time

import lmdb

from storage_backends.lmdb_environment import LmdbEnvironment, NoSpace
from storage_backends.lmdb_places import keys_in, place_value, recover_segments, unplace
from storage_backends.lmdb_segments import (
    Place,
    SegmentRecord,
    segment_key,
    unpack_place,
    unpack_segment,
    within,
)
from storage_backends.lmdb_values import SegmentValues
from storage_backends.segment_owners import owner_alive
from tiered_kv.errors import BackendError

log = logging.getLogger(__name__)

CHECK_EVERY_S = 1.0  # how often the dead bytes are summed (a cursor over the segments table)
MOVE_BATCH = 8  # values copied per transaction (each in a buffer of the compacting thread)
PAD_READS = 4096  # live values whose places one check reads to count their pads (a direct writer)
RECOVER_EVERY_S = 30.0  # how often a check looks for what processes that died left


class Compactor:
    """Handed the environment and the segment values; one compaction at a time per process."""

    def __init__(self, db: LmdbEnvironment, values: SegmentValues, dead_limit: int) -> None:
        self.db, self.values, self.dead_limit = db, values, dead_limit
        self._writer = values.files.writer  # how this process's copies are laid out
        self._pads: dict[int, tuple[int, int, int]] = {}  # segment -> (live bytes, values, pads) counted
        self._running = threading.Lock()
        self._checked = 0.0
        self._recovered: float | None = None  # when a check last looked for what dead processes left
        self._stuck: set[int] = set()  # victims none of whose values could be read (damage: check(fix))

    def dead_bytes(self) -> tuple[int, int]:
        """(dead bytes in sealed segments, dead bytes in all segments)."""
        sealed = every = 0
        with self.db.txn() as txn:
            for _, stored in txn.cursor(db=self.db.tables.segments):
                record = unpack_segment(stored)
                dead = max(0, record.end - record.live_bytes)
                every += dead
                sealed += dead if record.sealed else 0
        return sealed, every

    def maybe_compact(self, force: bool = False) -> int:
        """Compact the sparsest sealed segment if the dead bytes call for it (checked at most
        once a second unless ``force``); how many values moved."""
        now = time.monotonic()
        if not force and now - self._checked < CHECK_EVERY_S:
            return 0
        if not self._running.acquire(blocking=False):
            return 0
        try:
            self._checked = now
            if force or self._recovered is None or now - self._recovered >= RECOVER_EVERY_S:
                self._recovered = now
                self._seal_dead()
            victim = self._sparsest()
            if victim is None:
                return 0
            moved, unwritten = self._move(victim)
            if not moved and not unwritten and not self.values.files.fds.short:
                self._stuck.add(victim)  # not picked again, so the others' dead bytes still go
            # (a copy the disk refused, ENOSPC say, or values not read for want of descriptors
            # leave the victim to a later compaction)
            return moved
        finally:
            self._running.release()

    def _seal_dead(self) -> None:
        """Seal the open segments of processes that are gone and delete orphan files
        (:func:`~storage_backends.lmdb_places.recover_segments`, in a write transaction only when
        a read one found some). Nothing when ``/proc``, the directory or the map cannot be read
        or written now: the next look tries again."""
        files = self.values.files
        try:
            with self.db.txn() as txn:
                records = {int.from_bytes(bytes(sid), "big"): unpack_segment(stored)
                           for sid, stored in txn.cursor(db=self.db.tables.segments)}
            dead = any(not record.sealed and (record.owner_pid, record.owner_start) != (files.pid, files.start)
                       and not owner_alive(record, files.path_of(segment)) for segment, record in records.items())
            if not dead and files.files().keys() <= records.keys():
                return
            sealed, orphans = self.db.write(lambda w: recover_segments(self.db.tables, w, files))
        except (OSError, NoSpace) as exc:
            log.warning("lmdb tier at %s: what processes that are gone left not looked at: %s", self.db.path, exc)
            return
        if sealed or orphans:
            log.info("lmdb tier at %s: sealed %d segments of processes that are gone, deleted %d orphan "
                     "segment files", self.db.path, sealed, orphans)

    def _sparsest(self) -> int | None:
        dead, best, best_share = 0, None, 1.0
        reads, seen = [PAD_READS], set()
        with self.db.txn() as txn:
            for sid, stored in txn.cursor(db=self.db.tables.segments):
                record, segment = unpack_segment(stored), int.from_bytes(bytes(sid), "big")
                if not record.sealed or record.end <= 0 or segment in self._stuck:
                    continue
                seen.add(segment)
                pads = self._copy_pads(txn, segment, record, reads)
                reclaimable = max(0, record.end - record.live_bytes - pads)
                dead += reclaimable
                share = 1.0 - reclaimable / record.end  # (buffered: the live share)
                if share < best_share:
                    best, best_share = segment, share
        self._pads = {s: counted for s, counted in self._pads.items() if s in seen}  # (drained ones go)
        return best if dead > self.dead_limit else None

    def _copy_pads(self, txn, segment: int, record: SegmentRecord, reads: list[int]) -> int:
        """What this process's copies of ``segment``'s live values add to their lengths (none when
        it writes buffered): their pads as counted from their places, while ``reads`` (values
        this check may still read) lasts; else a page less a byte per value, or the pads counted
        before some of them left (values only leave a sealed segment: that only overstates)."""
        bound = record.live_entries * self._writer.max_pad
        if not bound:
            return 0
        counted = self._pads.get(segment)
        if counted is not None and counted[:2] == (record.live_bytes, record.live_entries):
            return counted[2]
        if counted is not None and counted[1] > record.live_entries:  # (the reads go to segments
            return min(counted[2], bound)  # never counted: churn in one must not starve the rest)
        if reads[0] > 0:  # (one segment per check at least, however many values it holds)
            reads[0] -= record.live_entries
            pads = 0
            for key in keys_in(self.db.tables, txn, segment):
                place = txn.get(key, db=self.db.tables.places)
                if place is not None:
                    length = unpack_place(place).length
                    pads += self._writer.stride(length) - length
            self._pads[segment] = (record.live_bytes, record.live_entries, pads)
            return pads
        return bound

    def _move(self, segment: int) -> tuple[int, int]:
        """(values moved out of ``segment``, values read but not written: the disk refused them)."""
        with self.db.txn() as txn:
            keys = list(keys_in(self.db.tables, txn, segment))
        moved = unwritten = 0
        for start in range(0, len(keys), MOVE_BATCH):
            batch_moved, batch_unwritten = self._move_batch(keys[start : start + MOVE_BATCH])
            moved, unwritten = moved + batch_moved, unwritten + batch_unwritten
        log.info("lmdb tier at %s: compacted segment %016x (%d values moved, %d not written)",
                 self.db.path, segment, moved, unwritten)
        return moved, unwritten

    def _move_batch(self, keys: list[bytes]) -> tuple[int, int]:
        with self.values.writing():  # as a put: a close waits for it
            self.db.check_open()
            return self._move_locked(keys)

    def _move_locked(self, keys: list[bytes]) -> tuple[int, int]:
        olds: list[Place] = []
        copies = []
        with self.db.txn() as txn:
            for slot, key in enumerate(keys):
                record = txn.get(key, db=self.db.tables.places)
                place = None if record is None else unpack_place(record)
                value = None if place is None or not self._inside(txn, place) else self.values.read(place, slot)
                if value is not None:
                    olds.append(place)
                    copies.append((key, value))
        if not copies:
            return 0, 0
        # the values were durable (a flush) before they moved, and stay so: the copies are fsync'd
        # before the swap names them, and a drained victim's file goes once the swap is durable
        news = self.values.write([value for _, value in copies])
        news = news if self.values.sync else self.values.durable(news)  # (with sync: fsync'd)
        drained: list[int] = []  # what the swap's commit drained
        held: set[int] = set()  # what its attempts held for deletion
        try:
            try:
                moved = self.db.write(lambda w: self._swap(w, [k for k, _ in copies], olds, news, drained, held))
            except NoSpace as exc:  # the disk (or map) is full: the copies are dead bytes, the
                log.warning("lmdb tier at %s: compaction's swap refused: %s", self.db.path, exc)  # victim stays
                return 0, len(copies)
            finally:
                self.values.settle(news)
            if self._durable(drained) and self.db.on_drained is not None:
                self.db.on_drained(drained)
        finally:
            self.values.let_go(held)
        return moved, sum(1 for new in news if new is None)

    def _inside(self, txn, place: Place) -> bool:
        """Whether ``place`` ends within what its segment's record says was appended to it (every
        place recorded does). A damaged one, naming more bytes than its segment ever held, is not
        read (a victim none of whose values read is passed over): the buffer for a length of
        terabytes cannot be had, and every compaction raised OSError at that victim for good."""
        stored = txn.get(segment_key(place.segment), db=self.db.tables.segments)
        return within(place, None if stored is None else unpack_segment(stored).end)

    def _swap(self, w, keys: list[bytes], olds: list[Place], news: list[Place | None], drained: list[int],
              held: set[int]) -> int:
        """Swap the places (the transaction's body: run again after a full map). The segments it
        drains are taken from the environment (handed back to it once :meth:`_durable`) into
        ``drained``, and held for deletion before the commit (``held``): till their files go, no
        check takes one for an orphan, no other process deletes it."""
        swapped = 0
        for key, old, new in zip(keys, olds, news):
            record = w.txn.get(key, db=self.db.tables.places)
            if new is None or record is None or bytes(record) != old.pack():
                continue  # not copied, or gone or moved meanwhile: the copy is dead bytes
            unplace(self.db.tables, w, key)
            place_value(self.db.tables, w, key, new)
            swapped += 1
        drained[:] = w.drained
        w.drained.clear()  # (the environment deletes their files once the commit is durable: _durable)
        for segment in drained:
            held.add(segment)
            self.values.hold_for_deletion(segment)
        return swapped

    def _durable(self, drained: list[int]) -> bool:
        """Whether the swap that drained segments is durable, so their files may go (LMDB synced
        it with ``sync``; else a machine crash could undo it, and put the values back in a file
        that is gone). When the sync fails they stay: orphans, a later recovery's."""
        if not drained or self.values.sync:
            return bool(drained)
        try:
            with self.db.shared():
                self.db.env.sync(True)
        except (lmdb.Error, BackendError) as exc:
            log.warning("lmdb tier at %s: compacted segments kept (sync failed): %s", self.db.path, exc)
            return False
        return True
