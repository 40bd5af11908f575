"""Closing a Redis tier while a call or the breaker's probe is still running (real server): no
connection of ours is left open, and a call after close() is a typed BackendClosed. A call or
probe is held at a point of its run by events, never by sleeping."""

from __future__ import annotations

import threading

import pytest
import redis

from storage_backends.registry import open_backend
from tiered_kv.errors import BackendClosed, BackendError, BackendUnavailable


def our_connections(server) -> int:
    """Clients connected to ``server`` other than the one asking."""
    admin = redis.Redis(port=server.port)
    try:
        me = admin.client_id()
        return sum(1 for c in admin.client_list() if int(c["id"]) != me)
    finally:
        admin.close()


def test_a_call_running_as_the_tier_closes_does_not_leave_its_connection_open(own_redis, monkeypatch):
    # close() disconnected the pool; the call still running took (made) a connection, ran, and put
    # it back into the closed pool still connected: a socket open for the life of the process
    b = open_backend(own_redis.url)
    assert b.put_many([(b"k", b"v")]) == [True]
    in_call, closed = threading.Event(), threading.Event()
    execute = redis.client.Pipeline.execute

    def held(pipe, *args, **kwargs):  # the caller's pipeline waits until close() has run
        if threading.current_thread() is caller:
            in_call.set()
            closed.wait(30)
        return execute(pipe, *args, **kwargs)

    monkeypatch.setattr(redis.client.Pipeline, "execute", held)
    outcomes: list = []

    def call() -> None:
        try:
            outcomes.append(b.get_many([b"k"]))
        except BackendError as exc:  # (typed: anything else escapes the thread and fails below)
            outcomes.append(type(exc))

    caller = threading.Thread(target=call)
    caller.start()
    assert in_call.wait(30)
    b.close()
    closed.set()
    caller.join(30)
    assert outcomes in ([[b"v"]], [BackendClosed], [BackendUnavailable])
    assert our_connections(own_redis) == 0
    with pytest.raises(BackendClosed):  # typed (a plain ValueError escaped the store's handlers)
        b.get_many([b"k"])


def test_a_probe_running_as_the_tier_closes_does_not_leave_its_connection_open(own_redis, monkeypatch):
    b = open_backend(own_redis.url, retries=0)
    assert b.put_many([(b"k", b"v")]) == [True]
    in_ping, closed = threading.Event(), threading.Event()
    ping = redis.Redis.ping

    def held(client, *args, **kwargs):  # the probe's ping waits until close() has run
        if threading.current_thread().name == "tiered-kv-redis-probe":
            in_ping.set()
            closed.wait(30)
        return ping(client, *args, **kwargs)

    monkeypatch.setattr(redis.Redis, "ping", held)
    own_redis.stop()
    with pytest.raises(BackendUnavailable):
        b.get_many([b"k"])  # the breaker opens; its probe starts
    own_redis.start()  # (same port)
    prober = b._breaker._prober
    assert in_ping.wait(30)
    b.close()
    closed.set()
    prober.join(30)
    assert not prober.is_alive() and our_connections(own_redis) == 0
