"""The LMDB tier on its failure paths: a segment read retried after a short read and a transient
error, an overwrite refused for want of room, a compaction the full disk refused, a tool's
read-only open of a store of the previous format, ``check(fix=True)`` of a value kept twice,
compaction of direct values shorter than a page, and the registration of a segment failing.
Real LMDB environments and segment files under tmp_path; faults are injected at the system call
(or segment write, or transaction) they stand for. Nothing depends on how fast this machine is
(compaction is forced, its automatic runs held off by ``dead_limit``)."""

from __future__ import annotations

import errno
import os

import lmdb
import numpy as np
import pytest

from storage_backends import lmdb_values, segment_io
from storage_backends.lmdb_disk import LmdbBackend
from storage_backends.segment_io import read_fully
from tiered_kv.errors import BackendUnavailable, ConfigError

KiB, MiB = 1 << 10, 1 << 20


def blob(i: int, n: int) -> bytes:
    return np.random.default_rng(i).bytes(n)


def key(i: int) -> bytes:
    return b"seg".ljust(16, b"\0") + i.to_bytes(16, "big")


def stored_format(path) -> int:
    with lmdb.open(str(path), max_dbs=16) as env:
        return format_in(env)


def format_in(env: lmdb.Environment) -> int:
    with env.begin() as txn:
        return int.from_bytes(txn.get(b"format", db=env.open_db(b"info", txn=txn)), "little")


def as_previous_version_left_it(path) -> None:
    """A format-2 store: no segment tables, the format says 2."""
    with lmdb.open(str(path), max_dbs=16) as env, env.begin(write=True) as txn:
        for name in (b"places", b"segments", b"segment_keys"):
            txn.drop(env.open_db(name, txn=txn), delete=True)
        txn.put(b"format", (2).to_bytes(8, "little"), db=env.open_db(b"info", txn=txn))


def table_names(path) -> list[bytes]:
    with lmdb.open(str(path), max_dbs=16) as env, env.begin() as txn:
        return [bytes(k) for k, _ in txn.cursor()]


# -- a read retried ------------------------------------------------------------------------------
def test_read_fully_leaves_the_callers_views_as_they_were(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 64)
    views = [memoryview(bytearray(1000)), memoryview(bytearray(3000))]
    before = list(views)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_fully(fd, views, 100) is True
    finally:
        os.close(fd)
    assert views == before and [len(v) for v in views] == [1000, 3000]
    assert bytes(views[0]) + bytes(views[1]) == path.read_bytes()[100:4100]


def test_regression_a_retried_partial_read_landed_its_bytes_shifted_and_deleted_a_good_block(tmp_path, monkeypatch):
    """A visit's read came back short, then failed with an errno that is not damage (ENOMEM):
    the read was tried again from its first byte, into views the first try had consumed, and
    said True over shifted bytes (the block's check then called it corrupt and dropped it)."""
    b = LmdbBackend(tmp_path / "db", capacity=64 * MiB, segment_bytes="4MiB")
    value = blob(1, 300 * KiB)
    assert b.put_many([(b"k", value)]) == [True]
    real = os.preadv
    calls = []

    def short_then_enomem(fd, bufs, offset):
        calls.append(offset)
        if len(calls) == 1:  # 4 KiB of it ...
            return real(fd, [memoryview(bufs[0])[:4096]], offset)
        if len(calls) == 2:  # ... then a transient failure that is not damage
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return real(fd, bufs, offset)

    got = {}

    def visitor(sizes, reader):
        into = bytearray(sizes[0])
        monkeypatch.setattr(segment_io.os, "preadv", short_then_enomem)
        try:
            got["answer"] = reader.read(0, 0, into)
        finally:
            monkeypatch.setattr(segment_io.os, "preadv", real)
        got["bytes"] = bytes(into)

    b.visit_ranges([b"k"], visitor)
    assert len(calls) == 3, "the read was retried once, from its first byte"
    assert got["answer"] is True and got["bytes"] == value
    assert b.get_many([b"k"]) == [value]
    b.close()


# -- an overwrite refused ------------------------------------------------------------------------
@pytest.mark.parametrize("size", [100 * KiB, 1000], ids=["segment", "lmdb-pages"])
def test_regression_an_overwrite_refused_for_want_of_room_lost_the_old_value_and_the_listener_never_heard(
        tmp_path, size):
    """The rest of the tier is pinned, so an overwrite by a larger value cannot be stored: the
    key's old value went with it, and the listener (which keeps an index of what the tier
    holds) went on believing the key was there."""
    b = LmdbBackend(tmp_path / "db", capacity=3 * size, segment_bytes="1MiB")
    told: list[tuple[str, list[bytes]]] = []
    b.listen(lambda change, keys: told.append((change, keys)))
    keys = [b"k0", b"k1", b"k2"]
    assert b.put_many([(k, blob(i, size)) for i, k in enumerate(keys)]) == [True] * 3
    b.pin_many(keys[:2])  # leased by readers: not to be evicted
    assert b.put_many([(b"k2", blob(9, size + size // 2))]) == [False]
    assert b.get_many(keys) == [blob(0, size), blob(1, size), None]
    assert told == [("stored", keys), ("removed", [b"k2"])]
    assert b.check() == []
    b.close()


# -- a compaction the disk refused ---------------------------------------------------------------
def test_regression_a_compaction_the_full_disk_refused_left_its_segment_stuck_for_good(tmp_path, monkeypatch):
    """The copies of one compaction failed (ENOSPC): its victim was marked stuck, as if its
    values were damaged, and never compacted again once the disk had room; the dead bytes
    stayed over the limit."""
    b = LmdbBackend(tmp_path / "db", capacity=8 * MiB, segment_bytes=MiB)  # limit: 2 MiB
    limit, b.compactor.dead_limit = b.compactor.dead_limit, 1 << 40  # (no compaction while filling)
    live = {}
    for s in range(12):
        batch = [key(5 * s + j) for j in range(5)]
        assert b.put_many([(k, blob(5 * s + j, 200 * KiB)) for j, k in enumerate(batch)]) == [True] * 5
        b.delete_many(batch[1:])  # a fifth stays
        live[batch[0]] = blob(5 * s, 200 * KiB)
    b.compactor.dead_limit = limit
    assert b.compactor.dead_bytes()[0] > limit

    def disk_full(self, segment, items):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(segment_io.SegmentWriter, "write_many", disk_full)
        assert b.compact() == 0
    assert not b.compactor._stuck, "a write the disk refused is no damage"
    for _ in range(30):
        if not b.compact():
            break
    assert b.compactor.dead_bytes()[0] <= limit
    assert b.get_many(list(live)) == list(live.values())
    assert b.check() == []
    b.close()


# -- a tool's read-only open ---------------------------------------------------------------------
def test_regression_a_read_only_open_upgraded_a_format_2_store_and_locked_out_the_previous_version(tmp_path):
    """``open_read_only`` (tools: nothing created) and its ``check()`` wrote format 3 and the
    segment tables into a store of the previous version, which that version then refused."""
    d = tmp_path / "db"
    with LmdbBackend(d, capacity=64 * MiB, segment_min="1GiB") as b:
        assert b.put_many([(b"k", blob(0, 1000))]) == [True]
    as_previous_version_left_it(d)
    names = table_names(d)
    tool = LmdbBackend.open_read_only(f"lmdb://{d}")
    assert tool.get_many([b"k", b"absent"]) == [blob(0, 1000), None]
    assert list(tool.scan()) == [b"k"]
    assert tool.stats().extra["segment_dead_bytes"] == 0
    assert tool.check() == []
    tool.close()
    assert stored_format(d) == 2 and table_names(d) == names


def test_a_read_only_open_of_a_previous_format_store_upgrades_it_at_its_first_write(tmp_path):
    """A tool that writes (a copy into the store, ``check(fix=True)``) upgrades it then, as a
    writer's open does, and what it wrote reads back in a writer of this version."""
    d = tmp_path / "db"
    with LmdbBackend(d, capacity=64 * MiB, segment_min="1GiB") as b:
        assert b.put_many([(b"k", blob(0, 1000))]) == [True]
    as_previous_version_left_it(d)
    tool = LmdbBackend.open_read_only(f"lmdb://{d}")
    assert format_in(tool.env) == 2
    assert tool.put_many([(b"big", blob(1, 100 * KiB)), (b"small", blob(2, 100))]) == [True, True]
    assert format_in(tool.env) == 3
    assert tool.get_many([b"big", b"small", b"k"]) == [blob(1, 100 * KiB), blob(2, 100), blob(0, 1000)]
    assert tool.check(fix=True) == []
    tool.close()
    with LmdbBackend(d, capacity=64 * MiB) as b:
        assert b.get_many([b"big", b"small", b"k"]) == [blob(1, 100 * KiB), blob(2, 100), blob(0, 1000)]
        with b.env.begin() as txn:
            assert b.values.place_of(txn, b"big") is not None
        assert b.check() == []


# -- check(fix=True) -----------------------------------------------------------------------------
def test_regression_check_fix_reported_a_value_both_in_the_block_table_and_a_segment_and_left_it(tmp_path):
    """A stale copy in LMDB's pages beside the value's segment place: ``check(fix=True)`` said
    so, kept both, and sized the meta from the stale copy; the next check said it again."""
    b = LmdbBackend(tmp_path / "db", capacity=64 * MiB, segment_bytes="1MiB")
    value = blob(0, 100 * KiB)
    assert b.put_many([(b"k", value)]) == [True]
    with b.env.begin(write=True) as txn:  # the damage
        txn.put(b"k", b"x" * 100, db=b.blocks)
    assert b.check(fix=True) == [f"value both in the block table and in a segment: {b'k'.hex()}"]
    assert b.check() == []
    assert b.get_many([b"k"]) == [value]
    assert b.entry_meta(b"k")["size"] == len(value)
    assert b.stats().used_bytes == len(value)
    b.close()


# -- compaction of direct values under a page ----------------------------------------------------
def filled_with_sub_page_values(path) -> LmdbBackend:
    """4 MiB of 1 KiB values written directly: each takes a 4 KiB page, three quarters pad."""
    b = LmdbBackend(path, capacity=4 * MiB, segment_bytes="1MiB", segment_min="1KiB", direct_io=True)
    limit, b.compactor.dead_limit = b.compactor.dead_limit, 1 << 40
    for start in range(0, 4096, 64):
        assert all(b.put_many([(b"k%06d" % j, blob(j, KiB)) for j in range(start, start + 64)]))
    b.compactor.dead_limit = limit
    return b


def test_regression_direct_pads_of_values_under_a_page_had_compaction_move_segments_round_and_round(direct_dir):
    """The pads counted as dead bytes over the limit, so each compaction copied a segment's
    values (pads and all) to a new one and freed nothing, again and again."""
    b = filled_with_sub_page_values(direct_dir)
    before = b.stats().extra["segment_bytes"]
    assert [b.compact() for _ in range(5)] == [0] * 5
    assert b.stats().extra["segment_bytes"] == before
    b.close()


def test_direct_compaction_still_frees_the_segments_of_deleted_sub_page_values(direct_dir):
    b = filled_with_sub_page_values(direct_dir)
    gone = [b"k%06d" % j for j in range(4096) if j % 8]
    assert b.delete_many(gone) == len(gone)
    before = b.stats().extra["segment_bytes"]
    moved = [b.compact() for _ in range(20)]
    assert sum(moved) > 0 and moved[-1] == 0
    assert b.stats().extra["segment_bytes"] < before // 2
    kept = [b"k%06d" % j for j in range(0, 4096, 8)]
    assert b.get_many(kept) == [blob(j, KiB) for j in range(0, 4096, 8)]
    assert b.check() == []
    b.close()


# -- a segment's own transactions failing ---------------------------------------------------------
def test_regression_an_io_error_registering_a_new_segment_reached_the_caller_as_a_raw_lmdb_error(tmp_path,
                                                                                                 monkeypatch):
    """The write transaction that registers a new segment (and the one sealing it) ran outside
    the put's guard: an I/O error there left put_many as ``lmdb.Error``, uncounted, which the
    store's save path does not take for a failed tier."""
    b = LmdbBackend(tmp_path / "db", capacity=64 * MiB)

    def commit_fails(tables, w, segment, record):  # the commit's I/O error, as LMDB raises it
        raise lmdb.Error("mdb_txn_commit: Input/output error")

    with monkeypatch.context() as m:
        m.setattr(lmdb_values, "register_segment", commit_fails)
        with pytest.raises(BackendUnavailable, match="Input/output error"):
            b.put_many([(key(0), blob(0, 100 * KiB))])
    assert b.stats().errors == 1 and b.get_many([key(0)]) == [None]
    assert b.put_many([(key(0), blob(0, 100 * KiB))]) == [True]  # the medium goes on
    assert b.get_many([key(0)]) == [blob(0, 100 * KiB)] and b.check() == []
    b.close()


@pytest.mark.parametrize("where", ["under_a_file", "exists_as_a_file"])
def test_regression_an_lmdb_path_that_cannot_be_made_raised_oserror_not_config_error(tmp_path, where):
    # the path's parent missing (or a file): mkdir's FileNotFoundError / NotADirectoryError
    # reached vLLM's schedule() when the scheduler opened its index at the first request
    (tmp_path / "a_file").write_bytes(b"x")
    path = tmp_path / "a_file" / "db" if where == "under_a_file" else tmp_path / "a_file"
    with pytest.raises(ConfigError, match="lmdb path"):
        LmdbBackend(path, capacity=1 << 20)
