"""The room an LMDB store holds for deletes on a full disk (``reserve.space``) is held again by
every writer that finds room, also after another process gave it up: a writer that trusted its
own memory of holding it never made it again, and the next full disk left it nothing to delete with."""

from __future__ import annotations

from storage_backends.lmdb_disk import LmdbBackend
from storage_backends.lmdb_diskfull import RESERVE_BYTES, RESERVE_NAME


def test_regression_the_reserve_another_process_gave_up_was_never_held_again(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=64 << 20)
    try:
        assert b.put_many([(b"k" * 16, b"v" * 4096)]) == [True]
        reserve = tmp_path / "db" / RESERVE_NAME
        assert reserve.stat().st_blocks * 512 >= RESERVE_BYTES, "real blocks, not a sparse file"
        reserve.unlink()  # another process's delete found the disk full and gave it up
        assert b.put_many([(b"j" * 16, b"v" * 4096)]) == [True]  # room again
        assert reserve.exists()
    finally:
        b.close()


def test_the_reserve_is_no_file_of_the_stores_data(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=64 << 20)
    try:
        b.put_many([(b"k" * 16, b"v" * 4096)])
    finally:
        b.close()
    assert RESERVE_NAME not in {p.name for p in LmdbBackend.store_files(tmp_path / "db")}
