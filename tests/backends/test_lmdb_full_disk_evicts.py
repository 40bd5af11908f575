"""An LMDB tier whose capacity is above what its disk really holds (a small tmpfs mounted for the
test, as in :mod:`tests.backends.test_lmdb_full_disk_mounted`): once the disk is full, a put
evicts the least recently used entries (the reserve given up so that the eviction's own commit
has room) and is stored, as when the tier's own capacity is reached; ``delete_if_unchanged``
(``verify --fix``) deletes on a full disk as plain deletes do (the reserve, then halves)."""

from __future__ import annotations

from storage_backends.cas_lmdb import delete_if_unchanged
from storage_backends.lmdb_disk import LmdbBackend
from tests.backends.test_lmdb_full_disk_mounted import fill, small_disk, value  # noqa: F401

KiB, MiB = 1 << 10, 1 << 20


def test_regression_a_put_on_a_full_lmdb_disk_was_refused_forever_instead_of_evicting_the_oldest(small_disk):  # noqa: F811
    b = LmdbBackend(small_disk / "db", capacity=1 << 30, segment_min=1 * MiB)  # every value in LMDB's pages
    try:
        stored = fill(b, 16 * KiB)
        oldest = sorted(stored)[:8]
        refused = b.figures().put_rejected
        new = [(b"new%05d" % i, value(100_000 + i, 16 * KiB)) for i in range(512)]  # (8 MiB: the disk's worth)
        ok = [b.put_many([item]) == [True] for item in new]
        assert all(ok[8:]), f"puts on the full disk kept being refused: {ok}"
        assert b.contains_many(oldest) == [False] * len(oldest), "the least recently used went first"
        assert b.get_many([k for k, _ in new[-8:]]) == [v for _, v in new[-8:]]
        assert b.figures().evictions > 0 and b.figures().errors == 0
        assert b.figures().put_rejected - refused <= 8
        assert b.check() == []
    finally:
        b.close()


def test_regression_a_put_of_segment_values_on_a_full_lmdb_disk_was_refused_forever(small_disk):  # noqa: F811
    b = LmdbBackend(small_disk / "db", capacity=1 << 30, segment_min=64 * KiB, segment_bytes=1 * MiB)
    try:
        stored = fill(b, 128 * KiB)  # eight values per segment file
        new = [(b"new%05d" % i, value(100_000 + i, 128 * KiB)) for i in range(32)]
        ok = [b.put_many([item]) == [True] for item in new]
        assert all(ok[8:]), f"puts on the full disk kept being refused: {ok}"
        assert b.contains_many(sorted(stored)[:4]) == [False] * 4
        assert b.get_many([k for k, _ in new[-8:]]) == [v for _, v in new[-8:]]
        assert b.figures().errors == 0
        assert b.check() == []
    finally:
        b.close()


def test_a_tools_open_without_capacity_still_refuses_a_put_on_a_full_disk(small_disk):  # noqa: F811
    b = LmdbBackend(small_disk / "db", capacity=None, segment_min=1 * MiB)
    try:
        stored = fill(b, 16 * KiB)
        for i in range(16):  # (no capacity: refused, nothing evicted)
            b.put_many([(b"late%d" % i, value(i, 16 * KiB))])
        assert b.contains_many(sorted(stored)) == [True] * len(stored)
    finally:
        b.close()


def test_regression_delete_if_unchanged_on_a_full_lmdb_disk_failed_whole(small_disk):  # noqa: F811
    b = LmdbBackend(small_disk / "db", capacity=1 << 30, segment_min=1 * MiB)
    try:
        stored = fill(b, 1 * KiB)  # many small values: deleting every other one copies every leaf page
        doomed = sorted(stored)[::2]
        changed = sorted(stored)[1]
        pairs = [(k, stored[k]) for k in doomed] + [(changed, b"changed")]
        assert delete_if_unchanged(b, pairs) == [True] * len(doomed) + [False]
        assert b.contains_many(doomed) == [False] * len(doomed)
        kept = sorted(stored)[1::2]
        assert b.get_many(kept) == [stored[k] for k in kept]
        assert b.figures().deletes == len(doomed)
        assert b.check() == []
    finally:
        b.close()
