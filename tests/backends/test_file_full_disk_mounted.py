"""The file medium on a real file system that fills before the tier's capacity is reached (an
8 MiB tmpfs mounted for the test; skipped where it cannot be mounted). ENOSPC failed the whole
put batch out to the engine (BackendUnavailable) and nothing was evicted: the tier stored nothing
more for good. Now the least recently used values go (as at the capacity) and the refused values
are written once more; a value still without room is a counted miss. Never an exception, never a
half-written value a reader sees, never a temporary file left behind."""

from __future__ import annotations

import errno

import pytest

from storage_backends.file_dir import FileBackend
from tests.backends.mounts import small_tmpfs

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZE = 64 * KiB


@pytest.fixture
def small_disk(tmp_path):
    with small_tmpfs(tmp_path / "disk", "8m") as mnt:
        yield mnt


def value(i: int, n: int = SIZE) -> bytes:
    return i.to_bytes(4, "little") * (n // 4)


def batch(first: int, n: int = 8) -> list[tuple[bytes, bytes]]:
    return [(b"k%06d" % i, value(i)) for i in range(first, first + n)]


def temporary_files(root) -> list[str]:
    return [p.name for p in root.rglob(".*.tmp")]


def fill(b: FileBackend, calls: int) -> list[list[bool]]:
    """``calls`` puts of 8 values each: what each said."""
    return [b.put_many(batch(8 * c)) for c in range(calls)]


def test_regression_a_file_store_on_a_disk_that_filled_below_its_capacity_failed_every_put(small_disk):
    root = small_disk / "files"
    with FileBackend(root, capacity=1 * GiB) as b:
        said = fill(b, 40)  # 20 MiB through an 8 MiB disk
        assert all(all(ok) for ok in said[-8:]), "room is made: the newest values are stored"
        counted = b.counters()
        assert counted.errors == 0 and counted.evictions > 0
        assert counted.extra["put_disk_full"] == counted.put_rejected
        newest = [k for k, _ in batch(8 * 39)]
        assert b.get_many(newest) == [v for _, v in batch(8 * 39)]
        values = dict(kv for c in range(40) for kv in batch(8 * c))
        for k, got in zip(values, b.get_many(list(values))):
            assert got is None or got == values[k], "a value reads whole or not at all"
        assert temporary_files(root) == []
        assert b.stats().used_bytes <= 8 * MiB


def test_a_full_disk_with_nothing_to_evict_refuses_the_values_a_counted_miss(small_disk):
    root = small_disk / "files"
    with FileBackend(root, capacity=1 * GiB) as b:
        said = []
        for c in range(40):
            items = batch(8 * c)
            b.pin_many([k for k, _ in items])  # (leased: none may go)
            said.append(b.put_many(items))
        refused = [k for c, ok in enumerate(said) for (k, _), f in zip(batch(8 * c), ok) if not f]
        assert refused, "the disk filled"
        counted = b.counters()
        assert counted.errors == 0 and counted.evictions == 0
        assert counted.put_rejected == counted.extra["put_disk_full"] == len(refused)
        assert b.contains_many(refused) == [False] * len(refused)
        assert b.get_many(refused) == [None] * len(refused)
        assert temporary_files(root) == []
        kept = [k for k, _ in batch(0)]
        overwrite = [(k, value(7_000_000 + i)) for i, k in enumerate(kept)]
        assert b.put_many(overwrite) == [False] * 8
        assert b.get_many(kept) == [v for _, v in batch(0)], "an overwrite refused leaves the old value whole"
        assert temporary_files(root) == []


def test_an_unbounded_file_store_on_a_full_disk_refuses_values_and_evicts_nothing(small_disk):
    # (no capacity: an export, say; its values are never evicted, a full disk only refuses more)
    root = small_disk / "files"
    with FileBackend(root) as b:
        said = fill(b, 40)
        assert not all(said[-1])
        counted = b.counters()
        assert counted.errors == 0 and counted.evictions == 0 and counted.put_rejected > 0
        assert b.get_many([k for k, _ in batch(0)]) == [v for _, v in batch(0)]
        assert temporary_files(root) == []


def test_a_value_larger_than_the_whole_disk_evicts_nothing(small_disk):
    root = small_disk / "files"
    with FileBackend(root, capacity=1 * GiB) as b:
        assert b.put_many(batch(0)) == [True] * 8
        assert b.put_many([(b"huge", value(1, 16 * MiB))]) == [False]
        assert b.counters().evictions == 0 and b.contains_many([k for k, _ in batch(0)]) == [True] * 8
        assert temporary_files(root) == []


def test_a_tenants_values_on_a_full_disk_leave_no_tenant_file_behind(small_disk):
    root = small_disk / "files"
    with FileBackend(root, capacity=1 * GiB, tenant_quota=1 * GiB) as b:
        for c in range(40):
            ok = b.put_many(batch(8 * c), tenant=b"t")
            assert ok == [True] * 8
        assert b.counters().errors == 0 and b.counters().evictions > 0
        assert b.check() == [] and temporary_files(root) == []


def fill_up(path) -> None:
    """A file at ``path`` (beside the store: not one of its values) taking all the room left."""
    with open(path, "wb", buffering=0) as fh:
        for chunk in (64 * KiB, 4 * KiB, 1):
            try:
                while True:
                    fh.write(b"\xff" * chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC


def test_regression_a_full_disk_evicted_a_file_per_value_refused_however_large_the_files_that_went(small_disk):
    # the room made was the refused values' bytes *and* as many files as values: on a disk short of
    # bytes (with inodes to spare) both large values went where the first made room for the batch
    root = small_disk / "files"
    with FileBackend(root, capacity=1 * GiB) as b:
        bigs = [(b"big1", value(1, 3 * MiB)), (b"big2", value(2, 3 * MiB))]
        assert b.put_many(bigs) == [True, True]
        assert b.put_many(batch(0, 40)) == [True] * 40  # 2.5 MiB through the 2 MiB left
        assert b.counters().evictions == 1, "the least recently used value made room for them all"
        assert b.get_many([b"big1", b"big2"]) == [None, bigs[1][1]]
        assert temporary_files(root) == []


def test_regression_a_value_larger_than_the_disk_kept_the_room_from_being_made_for_its_batchs_other_values(small_disk):
    root = small_disk / "files"
    with FileBackend(root, capacity=1 * GiB) as b:
        assert b.put_many(batch(0)) == [True] * 8
        fill_up(small_disk / "someone-elses")  # (no room left at all)
        said = b.put_many([(b"huge", value(1, 16 * MiB)), *batch(8)])
        assert said == [False] + [True] * 8, "the values that fit are written once room is made"
        counted = b.counters()
        assert counted.evictions == 8 and counted.extra["put_disk_full"] == 1
        assert b.contains_many([k for k, _ in batch(8)]) == [True] * 8
        assert temporary_files(root) == []


def test_a_disk_out_of_inodes_evicts_a_file_for_each_value_refused(tmp_path):
    # (bytes to spare: the room wanted is files, whatever the bytes of those that go)
    with small_tmpfs(tmp_path / "disk", "8m,nr_inodes=64") as mnt:  # (64 inodes: the size is an option list)
        root = mnt / "files"
        with FileBackend(root, capacity=1 * GiB) as b:
            assert all(b.put_many([(b"old%05d" % i, value(i, 4 * KiB)) for i in range(40)]))
            said = [b.put_many([(b"t%05d" % (8 * c + i), b"tiny") for i in range(8)]) for c in range(6)]
            assert said == [[True] * 8] * 6
            counted = b.counters()
            assert counted.errors == 0 and counted.evictions > 0 and counted.put_rejected == 0
            assert temporary_files(root) == []
