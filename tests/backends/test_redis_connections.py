"""A Redis tier's own connection cap (``max_connections``) is not Redis being away (real server)."""

from __future__ import annotations

import re
import tracemalloc

import pytest

from storage_backends.redis_deadline import call_deadline
from storage_backends.redis_pool import READ_SIZE, ConnectionsBusy, WaitingPool
from storage_backends.registry import open_backend
from tests.redis_server import calls_at_once
from tiered_kv.errors import BackendUnavailable


def test_regression_more_callers_than_connections_opened_the_breaker(redis_url):
    # redis-py's pool raised "Too many connections" at once to the caller that found every
    # connection in use; the tier took it for Redis down and failed every call for a probe
    # interval (8 threads over 2 connections: 160 of 160 calls failed)
    b = open_backend(redis_url, max_connections=2, timeout="10s")
    keys = [b"k%d" % i for i in range(16)]
    b.put_many([(k, b"v" * 1000) for k in keys])

    def read_all() -> None:
        assert b.get_many(keys) == [b"v" * 1000] * len(keys)

    failures = calls_at_once(read_all, rounds=20)
    assert failures == [] and b.available  # they waited their turn for a connection


def test_every_connection_held_too_long_is_a_counted_miss_and_the_breaker_stays_closed(redis_url):
    b = open_backend(redis_url, max_connections=1, timeout="200ms")
    assert b.put_many([(b"k", b"v")]) == [True]
    errors = b.stats().errors
    pool = b.client.connection_pool
    held = pool.get_connection()  # (another caller's call that does not end)
    try:
        with pytest.raises(BackendUnavailable, match="connections busy"):
            b.get_many([b"k"])
        assert b.available
    finally:
        pool.release(held)
    assert b.get_many([b"k"]) == [b"v"] and b.stats().errors == errors + 1


def test_a_wait_cut_short_by_the_call_s_deadline_says_what_it_waited(redis_url):
    # the error named the pool's whole wait (here 30 s) when the call's deadline had ended it
    # long before: "busy for 30 s" after 0.2 s sent whoever read the log after the wrong cause
    pool = WaitingPool.from_url(redis_url, max_connections=1, socket_timeout=30)
    held = pool.get_connection()  # (another caller's call that does not end)
    try:
        with call_deadline(0.2), pytest.raises(ConnectionsBusy) as caught:
            pool.get_connection()
    finally:
        pool.release(held)
        pool.disconnect()
    said = str(caught.value)
    assert "30" not in said and re.search(r"busy for 0\.\d+ s \(the rest of the call's deadline\)", said), said


def test_idle_connections_hold_no_read_buffer_each(redis_url):
    # with hiredis every connection kept a READ_SIZE (1 MiB) read buffer for its lifetime:
    # 64 connections made once and idle since held 64 MiB (max_connections 10,000: 10 GiB)
    pytest.importorskip("hiredis")
    b = open_backend(redis_url, max_connections=64)
    pool = b.client.connection_pool
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        connections = [pool.get_connection() for _ in range(64)]  # each connected (and read from)
        for connection in connections:
            pool.release(connection)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 8 * READ_SIZE, f"{grown} bytes for 64 idle connections"
    values = {b"k%d" % i: bytes([i]) * (3 * READ_SIZE + i) for i in range(8)}  # replies of many reads
    assert all(b.put_many(list(values.items())))

    def read_all() -> None:  # (threads reading at once, each into its own buffer)
        assert b.get_many(list(values)) == list(values.values())

    assert calls_at_once(read_all, rounds=5) == []
    b.close()
