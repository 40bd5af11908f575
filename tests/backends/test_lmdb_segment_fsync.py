"""The LMDB tier when the fsync of a segment file fails. Linux reports a failed writeback to
``fsync`` once per open file: the pages whose write failed are marked clean, and the next
``fdatasync`` of the same file returns 0 although their data never reached the disk. So a
segment whose fsync failed is never trusted again: a put whose bytes are in it is not stored,
the entries recorded in it are withdrawn (counted, told to the listener), no writer appends to
it any more, and the tier goes on with new segments.

Real LMDB environments and segment files under tmp_path, opened as an engine opens its tier; only
the disk's failure is faked, at ``os.fdatasync``: EIO once for the first segment file fsync'd
after it is armed (or a chosen one), the real call before and after (the kernel's report-once
answer). Another writer's place in the scenario is set by events, never by time."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest

from storage_backends.lmdb_segments import SUFFIX, unpack_place
from storage_backends.registry import open_backend
from tiered_kv.errors import BackendUnavailable

MiB = 1 << 20


def key(i: int) -> bytes:
    return b"fsync".ljust(16, b"\0") + i.to_bytes(16, "big")


def blob(i: int, n: int = MiB) -> bytes:
    return np.random.default_rng(i).bytes(n)


def segment_of(fd: int) -> int | None:
    """The segment whose file ``fd`` is open on (None: another file)."""
    name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
    return int(name[: -len(SUFFIX)], 16) if name.endswith(SUFFIX) else None


class WritebackFailsOnce:
    """``os.fdatasync`` of a disk whose writeback of a segment file failed: the first fsync of a
    segment file (of segment ``only`` when set) while armed answers EIO (after ``meanwhile()``,
    another writer's turn); every other fsync is the real one, so a later fsync of that file
    returns 0, as Linux's does."""

    def __init__(self, monkeypatch) -> None:
        self.real = os.fdatasync
        self.armed = True
        self.only: int | None = None  # the segment whose fsync fails (None: the first one fsync'd)
        self.failed: list[int] = []  # the segments it failed
        self.meanwhile = None
        monkeypatch.setattr(os, "fdatasync", self)

    def __call__(self, fd: int) -> None:
        segment = segment_of(fd)
        if segment is None or not self.armed or self.only not in (None, segment):
            return self.real(fd)
        self.armed = False
        if self.meanwhile is not None:
            self.meanwhile()
        self.failed.append(segment)
        raise OSError(errno.EIO, os.strerror(errno.EIO))


def place_of(backend, k: bytes):
    with backend.env.begin() as txn:
        record = txn.get(k, db=backend._db.tables.places)
    return None if record is None else unpack_place(record)


def lmdb_tier(tmp_path, sync: bool):
    return open_backend(f"lmdb://{tmp_path}/db?capacity=256MiB&segment_bytes=16MiB&sync={str(sync).lower()}")


def test_regression_a_put_whose_bytes_were_in_a_failed_writeback_was_acknowledged_by_the_next_fsync(
        tmp_path, monkeypatch):
    """Two writers put a value each into one segment; the first one's fsync fails (EIO) after
    the second one wrote. The second one's fsync of that file then returned 0 (the error is
    reported once), and its put was acknowledged as durable and recorded over bytes that were in
    the failed writeback."""
    b = lmdb_tier(tmp_path, sync=True)
    disk = WritebackFailsOnce(monkeypatch)
    files, wrote, second_wrote = b.values.files, [], threading.Event()
    real_write = files.write_many

    def write_many(segment, items):  # the real write, then the writer says where it wrote
        real_write(segment, items)
        wrote.append((threading.current_thread().name, segment))
        if threading.current_thread().name == "second":
            second_wrote.set()

    monkeypatch.setattr(files, "write_many", write_many)
    answers = {}
    second = threading.Thread(target=lambda: answers.update(second=b.put_many([(key(2), blob(2))])),
                              name="second", daemon=True)

    def meanwhile():  # inside the first writer's failing fsync: the second one has written
        second.start()
        assert second_wrote.wait(30), "the second writer never wrote"

    disk.meanwhile = meanwhile
    answers["first"] = b.put_many([(key(1), blob(1))])
    second.join(30)
    assert not second.is_alive()
    (_, segment), (_, other) = wrote
    assert segment == other == disk.failed[0], "both values were in the segment whose fsync failed"
    assert answers == {"first": [False], "second": [False]}
    assert b.get_many([key(1), key(2)]) == [None, None]
    stats = b.stats()
    assert (stats.put_rejected, stats.entries) == (2, 0)
    b.close()


def test_regression_a_flush_after_a_failed_one_claimed_the_puts_of_the_failed_writeback_durable(tmp_path,
                                                                                               monkeypatch):
    """Puts without sync, then a flush whose fsync failed (BackendUnavailable, rightly); the next
    flush's fsync of the same file returned 0 and it said every committed put was durable,
    while their bytes never reached the disk. They are withdrawn instead (counted, told), the
    next flush is right to succeed, and the tier goes on in a new segment."""
    b = lmdb_tier(tmp_path, sync=False)
    told = []
    b.listen(lambda change, keys: told.append((change, list(keys))))
    assert b.put_many([(key(i), blob(i)) for i in range(3)]) == [True] * 3
    poisoned = place_of(b, key(0)).segment
    disk = WritebackFailsOnce(monkeypatch)
    with pytest.raises(BackendUnavailable, match="fsync of segment"):
        b.flush()
    assert disk.failed == [poisoned]
    b.flush()  # its fsyncs succeed: and nothing it vouches for lies in the failed segment
    assert b.get_many([key(i) for i in range(3)]) == [None] * 3
    assert ("removed", [key(0), key(1), key(2)]) in told
    stats = b.stats()
    assert stats.extra["sync_failed_entries"] == 3
    assert (stats.entries, stats.used_bytes) == (0, 0)
    assert b.tenant_totals() == {}
    assert poisoned not in b.values.files.files(), "the withdrawn segment drained and its file went"
    assert b.put_many([(key(3), blob(3))]) == [True]
    assert place_of(b, key(3)).segment != poisoned
    b.flush()
    assert b.get_many([key(3)]) == [blob(3)]
    assert b.check() == []
    b.close()


def test_a_put_whose_bytes_were_in_a_failed_flush_and_committed_after_it_is_withdrawn_by_the_next_flush(
        tmp_path, monkeypatch):
    """A put without sync wrote its value, then a flush's fsync of that segment failed, then the
    put committed (it promised nothing). The next flush must not vouch for it: it is withdrawn
    first, and that flush is right to succeed."""
    b = lmdb_tier(tmp_path, sync=False)
    files = b.values.files
    wrote, flushed, answers = threading.Event(), threading.Event(), {}
    real_write = files.write_many

    def write_many(segment, items):  # the real write, then the put waits for the failed flush
        real_write(segment, items)
        wrote.set()
        assert flushed.wait(30), "the flush never came"

    monkeypatch.setattr(files, "write_many", write_many)
    disk = WritebackFailsOnce(monkeypatch)
    putting = threading.Thread(target=lambda: answers.update(put=b.put_many([(key(1), blob(1))])), daemon=True)
    putting.start()
    assert wrote.wait(30)
    with pytest.raises(BackendUnavailable, match="fsync of segment"):
        b.flush()
    flushed.set()
    putting.join(30)
    assert not putting.is_alive() and answers == {"put": [True]}
    b.flush()
    assert b.get_many([key(1)]) == [None]
    assert b.stats().extra["sync_failed_entries"] == 1
    assert disk.failed[0] not in files.files()
    b.close()


def test_after_a_failed_fsync_the_next_put_goes_to_a_new_segment_and_is_stored(tmp_path, monkeypatch):
    """A put whose segment's fsync failed is not stored; the next put is written to a new
    segment (none appends to the failed one again: a later fsync of it would prove nothing)
    and is stored, readable and flushed."""
    b = lmdb_tier(tmp_path, sync=True)
    disk = WritebackFailsOnce(monkeypatch)
    assert b.put_many([(key(1), blob(1))]) == [False]
    assert b.put_many([(key(2), blob(2))]) == [True]
    assert place_of(b, key(2)).segment != disk.failed[0]
    b.flush()
    assert b.get_many([key(1), key(2)]) == [None, blob(2)]
    assert b.stats().extra["sync_failed_entries"] == 0
    b.close()


def test_a_put_in_a_healthy_segment_is_stored_when_one_fsync_fails_for_another_writers_segment(
        tmp_path, monkeypatch):
    """Two writers append to segments of their own; the first one's fsync covers both segments
    and fails for the other writer's only. The first put is stored (its own bytes are on the
    disk); the other is not, although a second fsync of its file returns 0."""
    b = lmdb_tier(tmp_path, sync=True)
    files = b.values.files
    disk = WritebackFailsOnce(monkeypatch)
    disk.armed = False
    in_lane, other_wrote, wrote, answers = threading.Event(), threading.Event(), {}, {}
    real_write, real_sync = files.write_many, files.sync

    def put(name: str, i: int) -> threading.Thread:
        thread = threading.Thread(target=lambda: answers.update({name: b.put_many([(key(i), blob(i))])}),
                                  name=name, daemon=True)
        thread.start()
        return thread

    def write_many(segment, items):  # the first writer holds its lane until the other one wrote
        name = threading.current_thread().name
        if name == "first":
            in_lane.set()
            assert other_wrote.wait(30), "the other writer never wrote"
        real_write(segment, items)
        wrote[name] = segment
        if name == "other":
            disk.armed, disk.only = True, segment  # its segment's writeback fails
            other_wrote.set()

    def sync(*segments):  # the other writer's fsync comes once the first writer's put is done
        if threading.current_thread().name == "other":
            first.join(30)
        return real_sync(*segments)

    monkeypatch.setattr(files, "write_many", write_many)
    monkeypatch.setattr(files, "sync", sync)
    first = put("first", 1)
    assert in_lane.wait(30)
    other = put("other", 2)
    for thread in (first, other):
        thread.join(30)
        assert not thread.is_alive()
    assert wrote["first"] != wrote["other"] and disk.failed == [wrote["other"]]
    assert answers == {"first": [True], "other": [False]}
    assert b.get_many([key(1), key(2)]) == [blob(1), None]
    b.close()


def test_regression_a_flush_short_of_file_descriptors_withdrew_the_entries_of_a_healthy_segment(
        tmp_path, monkeypatch):
    """The flush could not open a segment to fsync it (the process out of descriptors, EMFILE,
    its idle ones closed already): no fsync ran, so nothing said a byte of it was lost, yet it was
    taken for a segment whose fsync failed: never appended to again, every entry in it withdrawn.
    That flush fails (not everything is durable); the next one fsyncs the segment, whose entries
    stay, and which the writer goes on appending to."""
    b = lmdb_tier(tmp_path, sync=False)
    assert b.put_many([(key(i), blob(i)) for i in range(3)]) == [True] * 3
    segment = place_of(b, key(0)).segment
    fds, refused, synced = b.values.files.fds, [], []
    real_hold, real_fdatasync = fds.hold, os.fdatasync

    def hold(seg, write=False):  # the first descriptor asked for is refused
        if not refused:
            refused.append(seg)
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_hold(seg, write)

    def fdatasync(fd):
        synced.append(segment_of(fd))
        return real_fdatasync(fd)

    monkeypatch.setattr(fds, "hold", hold)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    with pytest.raises(BackendUnavailable, match="fsync of segment"):
        b.flush()
    assert (refused, synced) == ([segment], [])
    b.flush()
    assert synced == [segment], "the next flush fsyncs it"
    assert b.get_many([key(i) for i in range(3)]) == [blob(i) for i in range(3)]
    assert b.stats().extra["sync_failed_entries"] == 0
    assert b.put_many([(key(3), blob(3))]) == [True] and place_of(b, key(3)).segment == segment
    assert b.check() == []
    b.close()
