"""A stand-in (a thread running queued loads while every worker is held by a save) that the
system cannot start ("can't start new thread") is neither an error raised into the engine that
submitted a load nor a place counted for good: the next load gets a stand-in."""

from __future__ import annotations

import threading

from tiered_kv.store.transfer import TransferPool


def test_a_stand_in_that_failed_to_start_does_not_keep_later_loads_from_getting_one(monkeypatch):
    pool = TransferPool(workers=1, max_save_bytes=1 << 20, max_load_bytes=1 << 20)
    stuck, running = threading.Event(), threading.Event()
    pool.try_submit_save(10, lambda: running.set() or stuck.wait(60))
    assert running.wait(10)  # the only worker is held by a save (a hung tier)
    real_start, refused = threading.Thread.start, []

    def start(thread: threading.Thread) -> None:
        if thread.name == "tiered-kv-load" and not refused:
            refused.append(thread)
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    try:
        first = pool.submit_load(10, lambda: "first")  # no stand-in: queued (not raised into the engine)
        assert refused, "no stand-in was asked for"
        second = pool.submit_load(10, lambda: "second")
        assert second.result(30) == "second", "the failed stand-in stayed counted: no load ran"
        assert first.result(30) == "first"  # while the save still hangs
        assert not stuck.is_set()
    finally:
        stuck.set()
        pool.close()
    assert pool.drain(10) and pool.queued_bytes() == {"save": 0, "load": 0}
