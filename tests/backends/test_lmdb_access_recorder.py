"""Reads past the bound of buffered accesses hand their recording to a thread of the tier: a
reader never opens a write transaction, so a load never waits for LMDB's one writer. Real LMDB
files under tmp_path."""

from __future__ import annotations

import gc
import threading
import weakref

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


def watch_write_transactions(b: LmdbBackend, thread_name: str, entered: threading.Event,
                             go: threading.Event | None = None) -> None:
    """``entered`` set when the thread named ``thread_name`` asks for a write transaction (only
    then, with ``go``: it waits for ``go`` before it gets one). Synchronisation only."""
    real = b._db.txn

    def txn(write: bool = False):
        if write and threading.current_thread().name == thread_name:
            entered.set()
            if go is not None:
                assert go.wait(60)
        return real(write=write)

    b._db.txn = txn


def test_regression_lru_order_right_after_reads_left_out_those_the_recorder_was_recording(tmp_path, monkeypatch):
    """While the recorder's run had the buffer (taken, not yet committed: its transaction updates
    five records a key, then commits), ``lru_order`` (as ``flush`` and ``check``) found no access
    pending and read the tables without the reads that had returned before it; it now waits for
    the run's commit."""
    monkeypatch.setattr(lmdb_environment, "MAX_TOUCHES", 4)
    b = LmdbBackend(tmp_path / "db", capacity=MiB)
    b.put_many([(k(i), b"v" * 100) for i in range(8)])
    took, go, wrote, order = threading.Event(), threading.Event(), threading.Event(), []
    real_take = b._db.accesses.take

    def take():  # the recorder's run holds what it took until ``go`` (synchronisation only)
        taken = real_take()
        if threading.current_thread().name == RECORDER and taken:
            took.set()
            assert go.wait(60)
        return taken

    b._db.accesses.take = take
    watch_write_transactions(b, "lru-order", wrote)
    try:
        b.get_many([k(i) for i in range(4)])  # past the bound: the recorder's run
        assert took.wait(60)
        asking = threading.Thread(target=lambda: order.append(b.lru_order()), name="lru-order", daemon=True)
        asking.start()
        until(lambda: wrote.is_set() or not asking.is_alive(), "lru_order waited for the run, or returned")
    finally:
        go.set()
    asking.join(70)
    assert order[0][-4:] == [k(i) for i in range(4)], "the keys read last are the most recently used"
    b.close()


def test_regression_a_put_right_after_reads_evicted_the_keys_read_while_the_recorder_waited_for_the_writer(
        tmp_path, monkeypatch):
    """The recorder took the buffer before it got LMDB's writer: a put that got the writer first
    evicted by an LRU order without the reads that had returned before it (the keys just read
    went). The buffer is now taken holding the writer: the put records those reads itself."""
    monkeypatch.setattr(lmdb_environment, "MAX_TOUCHES", 4)
    b = LmdbBackend(tmp_path / "db", capacity=800)  # eight values of 100 bytes
    b.put_many([(k(i), b"v" * 100) for i in range(8)])
    at_writer, go = threading.Event(), threading.Event()
    watch_write_transactions(b, RECORDER, at_writer, go)  # the recorder gets the writer after the put
    try:
        b.get_many([k(i) for i in range(4)])
        assert at_writer.wait(60)
        assert b.put_many([(k(8), b"v" * 100)]) == [True]
    finally:
        go.set()
    kept = [v is not None for v in b.get_many([k(i) for i in range(9)])]
    assert kept == [True] * 4 + [False] + [True] * 4, "the least recently used key went, not one just read"
    b.close()


def test_regression_a_tier_dropped_unclosed_was_kept_for_good_by_its_recorder_thread(tmp_path, monkeypatch):
    """The recorder's thread held the environment (its map and descriptors) as long as the
    process lived once it had run; a tier dropped without a close is collected again."""
    monkeypatch.setattr(lmdb_environment, "MAX_TOUCHES", 2)

    def read_then_dropped() -> tuple[weakref.ref, threading.Thread]:
        b = LmdbBackend(tmp_path / "db", capacity=MiB)
        b.put_many([(k(i), b"v" * 100) for i in range(4)])
        b.get_many([k(0), k(1)])
        until(lambda: b.entry_meta(k(0))["hits"] == 1, "the recorder ran")
        return weakref.ref(b._db), b._db.recorder._thread

    environment, thread = read_then_dropped()

    def collected() -> bool:
        gc.collect()  # (the tier's cycles; the recorder's run may have held it a moment longer)
        return environment() is None and not thread.is_alive()

    until(collected, "the tier collected, its recorder ended")


def test_a_full_map_that_refuses_the_accesses_is_said_once_a_minute_not_at_every_recording(tmp_path, caplog):
    """A read-heavy run on a full disk: every recording past the bound found no room and said so
    (one warning per 4,096 reads, before the recorder: per read past the bound)."""
    b = LmdbBackend(tmp_path / "db", capacity=MiB)
    b.put_many([(k(1), b"v" * 100)])

    def full(body, nbytes=0):
        raise lmdb_environment.NoSpace("the map stayed full")

    b._db.write = full
    caplog.set_level("WARNING", logger="storage_backends.lmdb_environment")
    for _ in range(3):
        b.get_many([k(1)])
        b._db.apply_pending()
    said = [r for r in caplog.records if "access times not recorded" in r.getMessage()]
    assert len(said) == 1
    del b._db.write
    b.close()
