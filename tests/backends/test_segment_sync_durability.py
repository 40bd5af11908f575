"""The names the segment files' fsyncs make durable. An fsync of a file does not make its directory
entry durable (fsync(2)): a new segment file needs the ``segments`` directory fsync'd, and that
directory, made by a store's first segment, needs its own entry in the store's directory fsync'd,
or a power loss after a flush could lose every segment file at once (their directory unnamed).

A real LMDB tier under tmp_path; the directory fsyncs are seen at ``os.fsync`` (the real call,
recorded with the path of the descriptor)."""

from __future__ import annotations

import os

from storage_backends.registry import open_backend
from tests.backends.test_lmdb_segment_fsync import blob, key


def test_regression_a_flush_left_the_new_segments_directory_unnamed_in_the_store_directory(tmp_path, monkeypatch):
    """A new store's first flush fsync'd its segment files and the ``segments`` directory, never
    the store directory holding that directory's name."""
    b = open_backend(f"lmdb://{tmp_path}/db?capacity=256MiB&segment_bytes=16MiB")
    real, synced = os.fsync, []

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert b.put_many([(key(1), blob(1))]) == [True]
    b.flush()
    store = str((tmp_path / "db").resolve())
    assert store + "/segments" in synced and store in synced, synced
    synced.clear()
    assert b.put_many([(key(2), blob(2))]) == [True]
    b.flush()
    assert store not in synced, "the store directory is fsync'd once, not by every flush"
    b.close()
