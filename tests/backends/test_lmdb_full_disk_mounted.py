"""The LMDB tier on a real file system that fills before the tier's capacity is reached (a small
tmpfs mounted for the test; skipped where it cannot be mounted: not root, no ``mount``). LMDB
reports most commits on a full disk as EIO ("short write, filesystem full?"), not ENOSPC; each
is a refused put, never an error out of ``put_many`` or ``flush``; what was stored before still
reads back as it was, and deletes still commit (in halves) so the store can write again."""

from __future__ import annotations

import pytest

from storage_backends.lmdb_disk import LmdbBackend
from tests.backends.mounts import small_tmpfs

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def small_disk(tmp_path):
    """A 12 MiB tmpfs at ``tmp_path/disk``, unmounted after the test."""
    with small_tmpfs(tmp_path / "disk", "12m") as mnt:
        yield mnt


def value(i: int, n: int) -> bytes:
    return i.to_bytes(4, "little") * (n // 4)


def fill(b: LmdbBackend, n: int) -> dict[bytes, bytes]:
    """Put values of ``n`` bytes, 8 a call, until a call has one refused or the full disk made a
    put evict (a capacity above what the disk holds): what is stored."""
    stored: dict[bytes, bytes] = {}
    for i in range(0, 100_000, 8):  # (far more than the disk holds: a hang guard)
        items = [(b"k%08d" % j, value(j, n)) for j in range(i, i + 8)]
        ok = b.put_many(items)
        stored.update((k, v) for (k, v), f in zip(items, ok) if f)
        if not all(ok) or b.figures().evictions:
            keys = sorted(stored)
            return {k: stored[k] for k, there in zip(keys, b.contains_many(keys)) if there}
    raise AssertionError("the disk never filled")


def test_regression_lmdb_on_a_disk_that_filled_raised_eio_out_of_put_many_and_flush(small_disk):
    b = LmdbBackend(small_disk / "db", capacity=1 << 30, segment_min=1 * MiB)  # every value in LMDB's pages
    stored = fill(b, 16 * KiB)
    assert stored, "values went in before the disk filled"
    figures = b.figures()
    assert figures.errors == 0 and figures.put_rejected + figures.evictions > 0  # refused or evicted, not failed
    assert b.put_many([(b"late", value(1, 16 * KiB))]) in ([True], [False])  # (not an error)
    keys = sorted(stored)[:16]
    assert b.get_many(keys) == [stored[k] for k in keys]  # accesses pending: recorded by the flush
    b.flush()  # (the accesses cannot be recorded: logged, not raised)
    b.close()
    with LmdbBackend.open_read_only(f"lmdb://{small_disk / 'db'}") as r:
        assert r.get_many(sorted(stored)) == [stored[k] for k in sorted(stored)]


def test_regression_a_delete_on_a_full_lmdb_disk_failed_whole_so_the_store_never_wrote_again(small_disk):
    b = LmdbBackend(small_disk / "db", capacity=1 << 30, segment_min=64 * KiB, segment_bytes=1 * MiB)
    stored = fill(b, 128 * KiB)  # segment values: eight per segment file
    doomed = sorted(stored)[: len(stored) // 2]
    assert b.delete_many(doomed) == len(doomed)
    assert b.contains_many(doomed) == [False] * len(doomed)
    kept = sorted(stored)[len(stored) // 2:]
    assert b.get_many(kept) == [stored[k] for k in kept]
    assert b.check() == []
    assert any(b.put_many([(b"new%d" % i, value(i, 128 * KiB)) for i in range(8)])), \
        "the room the deletes freed is written again"
    b.close()
