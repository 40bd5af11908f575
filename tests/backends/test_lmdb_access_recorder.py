"""Reads past the bound of buffered accesses hand their recording to a thread of the tier: a
reader never opens a write transaction, so a load never waits for LMDB's one writer. Real LMDB
files under tmp_path."""

from __future__ import annotations

import threading

from storage_backends import lmdb_environment
from storage_backends.lmdb_disk import LmdbBackend
from tests.backends.helpers import until

KiB, MiB = 1 << 10, 1 << 20
RECORDER = "tiered-kv-lmdb-accesses"


def k(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def recorders() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == RECORDER]


def test_regression_a_read_past_the_access_bound_waited_for_lmdbs_writer(tmp_path, monkeypatch):
    monkeypatch.setattr(lmdb_environment, "MAX_TOUCHES", 4)
    b = LmdbBackend(tmp_path / "db", capacity=MiB)
    values = [bytes([i]) * KiB for i in range(8)]
    b.put_many([(k(i), v) for i, v in enumerate(values)])
    held, release, ended = threading.Event(), threading.Event(), []

    def writer() -> None:  # another writer's transaction (a write-behind commit, its fsync)
        txn = b.env.begin(write=True)
        held.set()
        release.wait(60)  # set once the read returned; 60 s only when the read waited for it
        ended.append(True)
        txn.abort()

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    assert held.wait(10)
    try:
        assert b.get_many([k(i) for i in range(8)]) == values
        assert not ended, "the read waited for the writer's transaction to end"
    finally:
        release.set()
        t.join(70)
    until(lambda: [b.entry_meta(k(i))["hits"] for i in range(8)] == [1] * 8, "the recorder applied the reads")
    b.close()
    assert not recorders()


def test_reads_below_the_bound_start_no_thread_and_close_records_them(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=MiB)
    b.put_many([(k(1), b"x" * 100)])
    b.get_many([k(1)])
    assert not recorders() and b.stats().extra["pending_touches"] == 1
    b.close()
    again = LmdbBackend(tmp_path / "db", capacity=MiB)
    assert again.entry_meta(k(1))["hits"] == 1
    again.close()


def test_a_failed_recording_is_left_for_the_next_write_and_the_recorder_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(lmdb_environment, "MAX_TOUCHES", 2)
    b = LmdbBackend(tmp_path / "db", capacity=MiB)
    b.put_many([(k(i), b"v" * 100) for i in range(4)])
    real, calls = b._db.apply_pending, []

    def failing_once() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug in the first recording")
        real()

    b._db.recorder.apply = failing_once
    b.get_many([k(0), k(1)])
    until(lambda: calls, "the recorder ran")
    b.get_many([k(2), k(3)])
    until(lambda: [b.entry_meta(k(i))["hits"] for i in range(4)] == [1, 1, 1, 1], "the second run recorded every read")
    b.close()
