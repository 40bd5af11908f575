"""Closing a Redis tier whose breaker is open (real redis-server, stopped): the breaker's probe
waited for its next ping with ``time.sleep`` (a cool-down of up to 4 s), so after ``close()`` its
thread slept on, holding the tier. It waits on an event that close sets now: a probe waiting ends
and is joined by close; a probe inside a ping is not waited for (its ping ends by its deadline).
Nothing here is timed: the cool-down is an hour, and the tests look at the thread."""

from __future__ import annotations

import threading

import pytest
import redis

import storage_backends.redis_breaker as breaker
from storage_backends.registry import open_backend
from tiered_kv.errors import BackendUnavailable

AN_HOUR = 3600.0
GUARD_S = 60.0  # a hang guard only


def probes() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tiered-kv-redis-probe"]


def opened_and_tripped(server, monkeypatch):
    """A tier on ``server`` (stopped now) whose breaker is open, its probe waiting an hour to ping."""
    monkeypatch.setattr(breaker, "COOLDOWN_MIN", AN_HOUR)
    b = open_backend(server.url, retries=0)
    server.stop()
    with pytest.raises(BackendUnavailable):
        b.get_many([b"k"])
    assert not b.available and b._breaker._prober is not None
    return b, b._breaker._prober


def test_regression_the_breakers_probe_slept_out_its_cool_down_after_the_tier_closed(own_redis, monkeypatch):
    before = set(probes())
    b, prober = opened_and_tripped(own_redis, monkeypatch)
    b.close()
    assert not prober.is_alive(), "the probe outlived its closed tier (asleep until its next ping)"
    assert set(probes()) <= before


def test_a_close_does_not_wait_for_a_probe_inside_its_ping(own_redis, monkeypatch):
    monkeypatch.setattr(breaker, "COOLDOWN_MIN", 0.0)  # (the probe pings at once)
    in_ping, release = threading.Event(), threading.Event()
    ping = redis.Redis.ping

    def held(client, *args, **kwargs):  # the probe's ping waits until the test lets it go
        if threading.current_thread().name == "tiered-kv-redis-probe":
            in_ping.set()
            release.wait(GUARD_S)
        return ping(client, *args, **kwargs)

    monkeypatch.setattr(redis.Redis, "ping", held)
    b = open_backend(own_redis.url, retries=0)
    own_redis.stop()
    with pytest.raises(BackendUnavailable):
        b.get_many([b"k"])
    prober = b._breaker._prober
    assert in_ping.wait(GUARD_S), "the probe never pinged"
    closer = threading.Thread(target=b.close)
    closer.start()
    closer.join(GUARD_S)
    try:
        assert not closer.is_alive(), "close() waited for a probe inside its ping"
        assert prober.is_alive()  # (still held in its ping)
    finally:
        release.set()
    prober.join(GUARD_S)
    assert not prober.is_alive(), "the probe went on after its ping, the tier closed"
