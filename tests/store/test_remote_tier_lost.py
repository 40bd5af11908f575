"""A Redis tier that lost its content (restarted empty, flushed) is announced ``lost``, so a
router stops sending requests for prefixes that will all miss; a mere reconnect is not a loss."""

from __future__ import annotations

import socket
import time

import pytest

from tests.store.helpers import keys_for, make_store, payloads
from tests.store.test_block_events import replay
from tiered_kv.store.block_events import BlockEvents

GUARD_S = 60  # a hang guard only: nothing here asserts how long anything took


@pytest.fixture(autouse=True)
def _looks_often(monkeypatch):
    import storage_backends.redis_epoch as epoch

    monkeypatch.setattr(epoch, "CHECK_EVERY_S", 0.02)


def _wait(done, events, feed) -> None:
    end = time.monotonic() + GUARD_S
    while True:
        events += feed.take()
        if done():
            return
        assert time.monotonic() < end, "hang guard: never happened"
        time.sleep(0.01)


def _looks_past(backend, n: int = 2):
    """True once ``n`` more looks at the marker than now were made (each after the call)."""
    target = backend.epoch.looks + n
    return lambda: backend.epoch.looks >= target


def _lost(events) -> list:
    return [e for e in events if e.kind == "lost" and e.tier == "remote"]


def _redis(port: int, *command: bytes) -> bytes:
    wire = b"*%d\r\n" % len(command) + b"".join(b"$%d\r\n%s\r\n" % (len(c), c) for c in command)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(wire)
        return s.recv(1024)


def _stored_in_redis(store, own_redis, tmp_path, feed, events):
    keys = keys_for(4)
    store.save(keys, payloads(store, 4))
    store.flush()
    remote = store.tier("remote").backend
    assert store.tier("remote").contains(keys) == [True] * 4
    _wait(_looks_past(remote), events, feed)  # (the marker was seen before anything happens)
    assert replay(events, "remote") == set(keys) and not _lost(events)
    return remote


def test_a_flushall_by_another_client_is_announced_lost_and_later_saves_stored_again(tmp_path, own_redis):
    with make_store(tmp_path, disk=None, remote_url=own_redis.url) as store:
        feed, events = store.events.subscribe(), []
        remote = _stored_in_redis(store, own_redis, tmp_path, feed, events)
        own_redis.flushall()
        _wait(lambda: bool(_lost(events)), events, feed)
        assert replay(events, "remote") == set()  # a replaying router holds nothing there any more
        again = keys_for(3, first_token=50_000)
        store.save(again, payloads(store, 3, seed=1))
        store.flush()
        _wait(_looks_past(remote), events, feed)
        assert replay(events, "remote") == set(again) == {k[len(store.tier("remote").ns):] for k in remote.scan()}


def test_a_flushdb_is_announced_lost(tmp_path, own_redis):
    with make_store(tmp_path, disk=None, remote_url=own_redis.url) as store:
        feed, events = store.events.subscribe(), []
        _stored_in_redis(store, own_redis, tmp_path, feed, events)
        assert _redis(own_redis.port, b"FLUSHDB").startswith(b"+OK")
        _wait(lambda: bool(_lost(events)), events, feed)


def test_a_redis_server_restarted_empty_on_the_same_port_is_announced_lost(tmp_path, own_redis):
    with make_store(tmp_path, disk=None, remote_url=own_redis.url) as store:
        feed, events = store.events.subscribe(), []
        _stored_in_redis(store, own_redis, tmp_path, feed, events)
        own_redis.restart()  # no persistence: every block is gone
        _wait(lambda: bool(_lost(events)), events, feed)
        assert replay(events, "remote") == set()


def test_a_killed_connection_that_reconnects_to_the_same_server_is_no_loss(tmp_path, own_redis):
    with make_store(tmp_path, disk=None, remote_url=own_redis.url) as store:
        feed, events = store.events.subscribe(), []
        remote = _stored_in_redis(store, own_redis, tmp_path, feed, events)
        kept = replay(events, "remote")
        killed = _redis(own_redis.port, b"CLIENT", b"KILL", b"TYPE", b"normal")
        assert killed.startswith(b":") and int(killed[1:].split(b"\r\n")[0]) >= 1  # ours were cut
        assert store.tier("remote").contains(keys_for(4)) == [True] * 4  # (reconnects)
        _wait(_looks_past(remote, 3), events, feed)
        assert not _lost(events) and replay(events, "remote") == kept


def test_a_loss_twice_before_a_take_is_one_lost_event_in_its_place():
    events = BlockEvents()
    feed = events.subscribe()
    heard = events.listener("remote", b"ns")
    heard("stored", [b"nsa"])
    heard("lost", [])
    heard("lost", [])
    heard("stored", [b"nsb"])
    assert [(e.kind, e.keys) for e in feed.take()] == [("stored", (b"a",)), ("lost", ()), ("stored", (b"b",))]
