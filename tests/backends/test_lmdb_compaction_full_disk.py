"""A disk that fills at the wrong moment around the LMDB tier's segment writes: the commit of a
compaction's swap, the seal of a segment a put filled, a run of values the disk refuses whose
segment cannot be sealed either, recovery at open. Each is a refused write (``False``), a
compaction that moves nothing, or a seal tried again later, never an error the engine does not
know (the tier's internal ``NoSpace``, a ``KeyError``), and nothing is lost or left unsealed.
The full disk is injected where it strikes: LMDB raising ``DiskError`` (ENOSPC) from a write
transaction, ``pwritev`` raising ENOSPC. Real LMDB environments and segment files under
tmp_path."""

from __future__ import annotations

import errno
import os

import lmdb

from storage_backends import lmdb_compaction, lmdb_values
from storage_backends.lmdb_disk import LmdbBackend
from tests.backends.test_lmdb_multiprocess_compaction import assert_values, child, kill, opened, said, sparse
from tests.backends.test_lmdb_segments import KiB, key, labelled, segment_of, segment_records

N = 200 * KiB  # five values per 1 MiB segment


def disk_full(*args, **kwargs):
    raise lmdb.DiskError("mdb_txn_commit: No space left on device")


def put(b: LmdbBackend, indexes) -> list[bool]:
    return b.put_many([(key(i), labelled(key(i), 1, N)) for i in indexes])


def test_regression_a_disk_full_at_compactions_swap_raised_the_tiers_internal_error_out_of_compact(
        tmp_path, monkeypatch):
    b = opened(tmp_path / "db")
    live = sparse(b)
    victim = segment_of(b, key(0, "s"))
    monkeypatch.setattr(lmdb_compaction, "place_value", disk_full)
    assert b.compact() == 0  # the copy is dead bytes; the value stays where it was
    assert segment_of(b, key(0, "s")) == victim
    assert_values(b, live)
    assert b.check() == []
    monkeypatch.undo()
    assert b.compact() == 1, "a victim whose swap the disk refused is tried again"
    assert not b.values.files.path_of(victim).exists()
    assert_values(b, live)
    assert b.check() == []
    b.close()


def test_regression_a_disk_full_sealing_the_segment_a_put_filled_raised_out_of_put_many(tmp_path, monkeypatch):
    b = opened(tmp_path / "db")
    assert all(put(b, range(5)))  # the first segment is full
    first = segment_of(b, key(0))
    monkeypatch.setattr(lmdb_values, "seal_segments", disk_full)
    assert put(b, [5]) == [True]  # opens a second segment; the first's seal fails
    assert not segment_records(b)[first].sealed
    monkeypatch.undo()
    assert put(b, [6]) == [True]
    assert segment_records(b)[first].sealed, "a seal the disk refused is tried again"
    assert_values(b, {key(i): labelled(key(i), 1, N) for i in range(7)})
    assert b.check() == []
    b.close()


def test_regression_a_refused_run_whose_segment_could_not_be_sealed_was_settled_twice_and_raised_key_error(
        tmp_path, monkeypatch):
    # The run's places were settled, the seal of their (retired) segment raised, and the put's
    # clean-up settled the same places again: KeyError out of put_many, and the reservations in
    # the next segment were never settled, so it was never sealed.
    b = opened(tmp_path / "db")
    assert all(put(b, range(4)))
    first = segment_of(b, key(0))
    pwritev = os.pwritev

    def refused_once(*args):
        monkeypatch.setattr(os, "pwritev", pwritev)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", refused_once)  # the run in the first segment (key 4)
    monkeypatch.setattr(lmdb_values, "seal_segments", disk_full)
    assert put(b, [4, 5, 6]) == [False, True, True]  # 5 and 6 open a second segment
    monkeypatch.undo()
    second = segment_of(b, key(5))
    assert_values(b, {key(i): labelled(key(i), 1, N) for i in (0, 1, 2, 3, 5, 6)})
    assert b.get_many([key(4)]) == [None]
    assert b.check() == []
    b.close()
    records = segment_records(again := opened(tmp_path / "db"))
    assert records[first].sealed and records[second].sealed, "closing sealed every segment of the process"
    again.close()


def test_regression_a_disk_full_at_open_raised_the_tiers_internal_error_from_recovering_a_dead_writers_segment(
        tmp_path, monkeypatch):
    db = tmp_path / "db"
    proc = child(f"""
        b = LmdbBackend({str(db)!r}, capacity=64 * MiB, segment_bytes=MiB)
        assert b.put_many([(key(0), labelled(key(0), 1, N))]) == [True]
        pause(*b.values.files.open_segments())
    """)
    left = int(said(proc))
    kill(proc)
    monkeypatch.setattr(lmdb_values, "recover_segments", disk_full)
    b = opened(db)  # its open segment is not sealed yet
    assert not segment_records(b)[left].sealed
    monkeypatch.undo()
    b.compact()  # (a put's compaction check does the same, every 30 s)
    assert segment_records(b)[left].sealed
    assert_values(b, {key(0): labelled(key(0), 1, N)})
    assert b.check() == []
    b.close()


def test_regression_a_disk_full_under_check_fix_raised_the_tiers_internal_error(tmp_path, monkeypatch):
    from storage_backends import lmdb_disk
    from tiered_kv.errors import BackendUnavailable

    b = opened(tmp_path / "db")
    sparse(b)
    (b.values.files.dir / "0000000000abcdef.seg").write_bytes(b"x")  # something to repair
    real = lmdb_disk.check_tables

    def repairs_need_room(tables, txn, w, placed=None):
        if w is not None:
            raise lmdb.DiskError("mdb_put: No space left on device")
        return real(tables, txn, w, placed)

    monkeypatch.setattr(lmdb_disk, "check_tables", repairs_need_room)
    try:
        b.check(fix=True)
    except BackendUnavailable as exc:
        assert "no room to repair" in str(exc)
    else:
        raise AssertionError("a repair the disk had no room for was reported done")
    monkeypatch.undo()
    assert b.check() != []  # nothing was repaired: the orphan is still there
    b.close()
