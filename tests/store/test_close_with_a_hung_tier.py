"""A tier that hangs does not hang the store's close (an engine's shutdown): the close waits for
write-behind at most ``close_timeout``, counts what it gave up on (``saves_abandoned``), leaves a
medium a stuck write is still inside open (closing an LMDB environment under a transaction in
flight is undefined behaviour) and closes the others. The hang is real: another process holds
the LMDB environment's writer lock, which LMDB waits for without bound."""

from __future__ import annotations

import multiprocessing
import threading

import pytest

from tests.store.helpers import keys_for, make_store, payloads
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import BackendClosed, ConfigError, StoreClosed, ThreadsUnavailable
from tiered_kv.store.transfer import TransferPool

BOUND_S = 60  # generous: the close waits 1 s (``close_timeout``) and then again at most 1 s


def hold_writer_lock(path: str, holding, release) -> None:
    """(another process) Begin a write transaction on the environment at ``path``, and hold it
    until ``release`` is set."""
    import lmdb

    env = lmdb.open(path, max_dbs=64)
    txn = env.begin(write=True)
    holding.set()
    release.wait(300)
    txn.abort()
    env.close()


class WriterLock:
    """The disk tier's writer lock, taken by another process (``take``, once the store is open:
    opening an environment writes) until ``release``."""

    def __init__(self, path: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.path, self._holding, self._release = path, ctx.Event(), ctx.Event()
        self._holder = ctx.Process(target=hold_writer_lock, args=(path, self._holding, self._release), daemon=True)

    def take(self) -> None:
        self._holder.start()
        assert self._holding.wait(BOUND_S), "the other process did not take the writer lock"

    def release(self) -> None:
        self._release.set()


@pytest.fixture
def writer_lock(tmp_path):
    lock = WriterLock(str(tmp_path / "lmdb"))
    yield lock
    lock.release()
    if lock._holder.pid is not None:
        lock._holder.join(BOUND_S)


def _close_within_bound(store) -> None:
    closer = threading.Thread(target=store.close, daemon=True)
    closer.start()
    closer.join(BOUND_S)
    assert not closer.is_alive(), "close() hung as long as the tier hung"


def test_a_save_stuck_on_lmdbs_writer_lock_does_not_hang_the_close(tmp_path, writer_lock):
    store = make_store(tmp_path, close_timeout=1,
                       tiers=[{"name": "shared", "url": f"file://{tmp_path}/files"}])
    writer_lock.take()
    keys = keys_for(4)
    done = store.save(keys, payloads(store, 4))
    assert done is not None and not done.done()  # queued, held by the lock
    assert store.flush(0.05) is False  # an explicit flush with a timeout: says so, gives nothing up
    _close_within_bound(store)
    # (taken now: once the tier answers, the thread may close the medium and end before a look)
    later = [t for t in threading.enumerate() if t.name == "tiered-kv-close-later"]
    assert store.metrics.events["saves_abandoned"] == 4
    disk, shared = store.tier("disk").backend, store.tier("shared").backend
    with pytest.raises(BackendClosed):
        shared.contains_many([b"k"])  # the medium no write was inside: closed
    assert disk.contains_many([b"k"]) == [False]  # the one a write is stuck in: left open
    writer_lock.release()  # the tier answers again: the stuck write ends, nothing crashed
    assert store.pool.drain(BOUND_S)
    for thread in later:  # then the medium left open is closed: the store can be opened again
        thread.join(BOUND_S)
    assert later and not any(t.is_alive() for t in later)
    with pytest.raises(BackendClosed):
        disk.contains_many([b"k"])
    with make_store(tmp_path) as again:  # (py-lmdb refused a second open of an environment left open)
        assert again.lookup(keys) == 4  # the write landed in the environment left open


def test_a_write_queued_behind_a_stuck_one_fails_and_is_counted_at_close(tmp_path, writer_lock):
    store = make_store(tmp_path, close_timeout=1, workers=1)
    writer_lock.take()
    first = store.save(keys_for(2), payloads(store, 2))
    second = store.save(keys_for(3, first_token=1000), payloads(store, 3))
    assert first is not None and second is not None
    _close_within_bound(store)
    assert isinstance(second.exception(BOUND_S), StoreClosed)  # never started: never runs
    assert not first.done()  # still running, on its daemon thread
    assert store.metrics.events["saves_abandoned"] == 5
    writer_lock.release()
    assert first.result(BOUND_S) is not None
    store.tier("disk").backend.close()


def test_a_pool_closed_with_a_timeout_leaves_a_stuck_job_and_fails_the_queued_ones():
    pool = TransferPool(workers=1, max_save_bytes=1 << 20, max_load_bytes=1 << 20)
    stuck, running = threading.Event(), threading.Event()
    hung = pool.try_submit_save(10, lambda: running.set() or stuck.wait(BOUND_S))
    assert running.wait(BOUND_S)
    queued_save = pool.try_submit_save(20, lambda: "never")
    queued_load = pool.submit_load(30, lambda: "never")  # (a stand-in may run it first)
    left = pool.close(0)
    assert (left.failed_save_bytes, left.running, left.running_save_bytes) == (20, 1, 10)
    assert isinstance(queued_save.exception(BOUND_S), StoreClosed)
    assert queued_load.exception(BOUND_S) is None or isinstance(queued_load.exception(), StoreClosed)
    stuck.set()
    assert hung.result(BOUND_S) is True
    assert pool.drain(BOUND_S) and pool.queued_bytes() == {"save": 0, "load": 0}
    for worker in pool._threads:  # (it ends at the stop signal once its job is done)
        worker.join(BOUND_S)
        assert not worker.is_alive()


def test_a_worker_that_cannot_start_does_not_leave_the_others_running(monkeypatch):
    real_start, started = threading.Thread.start, []

    def start(thread: threading.Thread) -> None:
        if started:
            raise RuntimeError("can't start new thread")
        started.append(thread)
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(ThreadsUnavailable):
        TransferPool(workers=3, max_save_bytes=1 << 20, max_load_bytes=1 << 20)
    monkeypatch.undo()
    assert len(started) == 1
    started[0].join(BOUND_S)
    assert not started[0].is_alive(), "the worker started first was left running"


def test_close_timeout_is_a_duration_or_none():
    assert TieredKVConfig().close_timeout == 30.0
    assert TieredKVConfig.from_dict({"close_timeout": "2s"}).close_timeout == 2.0
    assert TieredKVConfig.from_dict({"close_timeout": "none"}).close_timeout is None
    for bad in (0, "2d", "soon"):
        with pytest.raises(ConfigError, match="close_timeout"):
            TieredKVConfig.from_dict({"close_timeout": bad})
