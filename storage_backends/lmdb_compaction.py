"""Compaction of the LMDB tier's segment files. Evicting or overwriting a value in a segment
leaves its bytes there until the whole segment drains; a segment held by a few long-lived
values (a shared prefix's first blocks) would keep the rest of its file forever. When the dead
bytes of sealed segments exceed ``dead_limit``, the live values of the sparsest sealed segment
(the one with the smallest live share) are copied to an open segment of this process (the
compacting writer's lane) and their places swapped in one transaction, each
only if the value still lies where it was read (a value overwritten, deleted or moved by another
process meanwhile keeps its new place; the copy is dead bytes). The old segment then drains and
its file goes. Disk use stays within the capacity plus ``dead_limit`` plus the open segments.
A direct writer (``direct_io``) pads each value it writes to a whole page, so its copies take
pads again: its compaction counts up to a page less a byte per live value as that value's pad,
not reclaimable (else a store of values under a page would be moved round and round without
freeing anything). A victim none of whose values can be read is passed over from then on
(damage: ``check(fix)``); one whose copies the disk refused is tried again later."""

from __future__ import annotations

import logging
import threading
import time

from storage_backends.lmdb_environment import LmdbEnvironment
from storage_backends.lmdb_places import place_value, unplace
from storage_backends.lmdb_segments import Place, SegmentRecord, segment_key, unpack_place, unpack_segment
from storage_backends.lmdb_values import SegmentValues

log = logging.getLogger(__name__)

CHECK_EVERY_S = 1.0  # how often the dead bytes are summed (a cursor over the segments table)
MOVE_BATCH = 8  # values copied per transaction (each in a buffer of the compacting thread)


class Compactor:
    """Handed the environment and the segment values; one compaction at a time per process."""

    def __init__(self, db: LmdbEnvironment, values: SegmentValues, dead_limit: int) -> None:
        self.db, self.values, self.dead_limit = db, values, dead_limit
        self._max_pad = values.files.writer.max_pad  # what a copy of a value may add to it
        self._running = threading.Lock()
        self._checked = 0.0
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
            victim = self._sparsest()
            if victim is None:
                return 0
            moved, unwritten = self._move(victim)
            if not moved and not unwritten:
                self._stuck.add(victim)  # not picked again, so the others' dead bytes still go
            # (a copy the disk refused, ENOSPC say, leaves the victim to a later compaction)
            return moved
        finally:
            self._running.release()

    def _sparsest(self) -> int | None:
        dead, best, best_share = 0, None, 1.0
        with self.db.txn() as txn:
            for sid, stored in txn.cursor(db=self.db.tables.segments):
                record = unpack_segment(stored)
                if not record.sealed or record.end <= 0:
                    continue
                if int.from_bytes(bytes(sid), "big") in self._stuck:
                    continue
                reclaimable = self._reclaimable(record)
                dead += reclaimable
                share = 1.0 - reclaimable / record.end  # (buffered: the live share)
                if share < best_share:
                    best, best_share = int.from_bytes(bytes(sid), "big"), share
        return best if dead > self.dead_limit else None

    def _reclaimable(self, record: SegmentRecord) -> int:
        """The bytes moving a segment's live values would free: its dead bytes, less the pads
        this process's copies of them may take (none when it writes buffered)."""
        dead = max(0, record.end - record.live_bytes)
        return max(0, dead - record.live_entries * self._max_pad)

    def _move(self, segment: int) -> tuple[int, int]:
        """(values moved out of ``segment``, values read but not written: the disk refused them)."""
        prefix = segment_key(segment)
        with self.db.txn() as txn:
            cursor = txn.cursor(db=self.db.tables.segment_keys)
            keys = []
            if cursor.set_range(prefix):
                for entry in cursor.iternext(keys=True, values=False):
                    if bytes(entry[:8]) != prefix:
                        break
                    keys.append(bytes(entry[8:]))
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
                value = None if record is None else self.values.read(unpack_place(record), slot)
                if value is not None:
                    olds.append(unpack_place(record))
                    copies.append((key, value))
        if not copies:
            return 0, 0
        news = self.values.write([value for _, value in copies])
        try:
            moved = self.db.write(lambda w: self._swap(w, [k for k, _ in copies], olds, news))
        finally:
            self.values.settle(news)
        return moved, sum(1 for new in news if new is None)

    def _swap(self, w, keys: list[bytes], olds: list[Place], news: list[Place | None]) -> int:
        swapped = 0
        for key, old, new in zip(keys, olds, news):
            record = w.txn.get(key, db=self.db.tables.places)
            if new is None or record is None or bytes(record) != old.pack():
                continue  # not copied, or gone or moved meanwhile: the copy is dead bytes
            unplace(self.db.tables, w, key)
            place_value(self.db.tables, w, key, new)
            swapped += 1
        return swapped
