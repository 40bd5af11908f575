"""A Redis call that fails when no thread can be started for the breaker's probe (a process at
its thread limit, or at interpreter exit: ``RuntimeError: can't start new thread``). Real
redis-server, stopped and started again on its port; only the probe thread's start is refused.
The RuntimeError escaped the call (an untyped error from the medium), and the breaker stayed open
with no probe to close it: every call after failed at once, "next probe in 0.0s", for good."""

from __future__ import annotations

import logging
import threading

import pytest

from storage_backends.registry import open_backend
from tiered_kv.errors import BackendUnavailable


@pytest.fixture
def no_probe_thread(monkeypatch):
    """Thread.start refuses the breaker's probe thread, as a process at its thread limit does."""
    start = threading.Thread.start

    def refusing(thread: threading.Thread) -> None:
        if thread.name == "tiered-kv-redis-probe":
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refusing)


def test_regression_a_probe_thread_that_could_not_start_left_the_breaker_open_for_good(own_redis, no_probe_thread,
                                                                                     caplog):
    caplog.set_level(logging.WARNING, logger="storage_backends.redis_breaker")
    b = open_backend(own_redis.url, retries=0)
    try:
        assert b.put_many([(b"k", b"v")]) == [True]
        own_redis.stop()
        with pytest.raises(BackendUnavailable):  # typed: a RuntimeError escaped the call
            b.get_many([b"k"])
        assert b.available and b._breaker._prober is None  # not opened with nobody to close it
        [said] = [r.getMessage() for r in caplog.records if r.name == "storage_backends.redis_breaker"]
        assert "no probe thread could be started" in said, said
        own_redis.start()  # (same port, empty)
        assert b.put_many([(b"k", b"v")]) == [True]  # the next call asks the server again
        assert b.get_many([b"k"]) == [b"v"]
    finally:
        b.close()
