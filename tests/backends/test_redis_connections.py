"""A Redis tier's own connection cap (``max_connections``) is not Redis being away (real server)."""

from __future__ import annotations

import pytest

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
