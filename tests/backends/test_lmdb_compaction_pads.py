"""The pads compaction holds back from the dead bytes it may reclaim: what a copy of each live
value really adds under this process's writer (a direct one pads a value to a whole page; a
buffered one adds nothing), not a flat page less a byte per value."""

from __future__ import annotations

import pytest

from storage_backends.lmdb_disk import LmdbBackend
from storage_backends.segment_io import ALIGN
from tests.backends.test_lmdb_segments import blob, key, segment_records

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture(params=["buffered", "direct"])
def store_dir(request, tmp_path):
    """A store directory and whether it is written directly (``direct_dir`` when it is)."""
    if request.param == "direct":
        return request.getfixturevalue("direct_dir"), True
    return tmp_path / "db", False


def half_deleted(path, direct: bool, n: int) -> tuple[LmdbBackend, dict[bytes, bytes]]:
    """8 MiB of ``n``-byte values, every other one deleted: half of each segment dead."""
    b = LmdbBackend(path, capacity=12 * MiB, segment_bytes="1MiB", segment_min="1KiB", direct_io=direct)
    limit, b.compactor.dead_limit = b.compactor.dead_limit, 1 << 40  # none while filling
    count = 8 * MiB // n
    for start in range(0, count, 64):
        assert all(b.put_many([(key(j), blob(j, n)) for j in range(start, min(count, start + 64))]))
    assert b.delete_many([key(j) for j in range(1, count, 2)]) == count // 2
    b.compactor.dead_limit = limit
    return b, {key(j): blob(j, n) for j in range(0, count, 2)}


def test_regression_dead_bytes_of_page_sized_values_over_the_limit_were_never_compacted(store_dir):
    # a direct writer held back 4095 bytes per live value as its copy's pad, though a value of
    # whole pages takes none: half-dead segments counted ~nothing reclaimable, and their dead
    # bytes stayed over the limit (the disk over capacity plus the limit) for good
    path, direct = store_dir
    b, live = half_deleted(path, direct, 4 * KiB)
    limit = b.compactor.dead_limit
    assert b.compactor.dead_bytes()[0] > limit
    rounds = [b.compact() for _ in range(20)]
    assert sum(rounds) > 0 and rounds[-1] == 0
    assert b.compactor.dead_bytes()[0] <= limit, "dead bytes over the limit left uncompacted"
    assert b.stats().extra["segment_bytes"] <= 12 * MiB + limit + MiB
    assert b.get_many(list(live)) == list(live.values())
    assert b.check() == []
    b.close()


def reclaimable(b: LmdbBackend, pad: int) -> int:
    """The dead bytes of the sealed segments less ``pad`` per live value."""
    return sum(max(0, r.end - r.live_bytes - r.live_entries * pad) for r in segment_records(b).values() if r.sealed)


def test_a_direct_writer_holds_back_each_values_own_pad_and_compacts_once_the_rest_is_over_the_limit(direct_dir):
    # values of a page and a half: a copy takes half a page of pad, not a page less a byte
    b, live = half_deleted(direct_dir, True, ALIGN + ALIGN // 2)
    real, flat = reclaimable(b, ALIGN // 2), reclaimable(b, ALIGN - 1)
    assert real > flat + MiB
    b.compactor.dead_limit = real  # never counted beyond what moving the values frees
    assert b.compact() == 0
    b.compactor.dead_limit = (real + flat) // 2  # over it counted right, under it counted flat
    assert b.compact() > 0
    assert b.get_many(list(live)) == list(live.values())
    b.close()


def test_regression_a_segment_losing_values_every_check_kept_the_pad_reads_from_the_others(direct_dir, monkeypatch):
    # each check spent its budget of pad reads on the segments whose counts had changed, in
    # segment order, before any never counted: eviction chipping at the first segment (as many
    # live values as the budget) kept every other segment on the flat page-per-value bound
    import storage_backends.lmdb_compaction as compaction
    from storage_backends.lmdb_segments import unpack_place

    monkeypatch.setattr(compaction, "PAD_READS", 100)  # (128 MiB segments of 32 KiB values: 4096)

    def opened():
        return LmdbBackend(direct_dir, capacity=64 * MiB, segment_bytes="1MiB", segment_min="1KiB", direct_io=True)

    b = opened()
    b.compactor.dead_limit = 1 << 40
    keys = [key(j) for j in range(8 * MiB // (4 * KiB))]
    for start in range(0, len(keys), 64):
        assert all(b.put_many([(keys[j], blob(j, 4 * KiB)) for j in range(start, min(len(keys), start + 64))]))
    places = b.env.open_db(b"places", create=False)
    with b.env.begin() as txn:
        where = {k: unpack_place(txn.get(k, db=places)).segment for k in keys}
    first = min(s for s, r in segment_records(b).items() if r.sealed)
    churned = [k for k in keys if where[k] == first]
    assert len(churned) > compaction.PAD_READS + 40
    assert b.delete_many([k for k in keys if where[k] != first][1::2]) > 0  # the rest half dead
    b.close()
    b = opened()  # restarted: nothing counted yet
    b.compactor.dead_limit = 256 * KiB
    moved = 0
    for k in churned[:30]:  # eviction keeps chipping at the first segment
        b.delete_many([k])
        moved += b.compactor.maybe_compact(force=True)
    dead = b.compactor.dead_bytes()[0]
    b.close()
    assert moved > 0, f"{dead} dead bytes over a 256 KiB limit, nothing compacted in 30 checks"
