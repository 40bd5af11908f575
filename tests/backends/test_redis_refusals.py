"""Redis tier when a Redis that is up refuses (real servers, no mocks): writes refused by a
read-only replica (READONLY) or a failing RDB save (MISCONF), INFO denied by an ACL (NOPERM),
memory full (OOM), and a key of ours overwritten with another type by someone else. Reads
still count; a refusal is typed (BackendError) and counted, never a raw redis-py error, and
the breaker stays closed."""

from __future__ import annotations

import logging
import shutil
import time

import pytest
import redis

from storage_backends import redis_remote
from storage_backends.log_throttle import LogThrottle
from storage_backends.registry import open_backend
from tests.redis_server import RedisServer
from tests.store.helpers import keys_for, load, make_store, payloads
from tiered_kv.errors import BackendError, BackendUnavailable

BOUND_S = 30.0  # a bound, not a figure: how long a server-side state change may take to show


def until(check, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def misconf(server: RedisServer) -> redis.Redis:
    """Put ``server`` in MISCONF: snapshots configured, the last one failed (its directory is gone)."""
    r = redis.Redis(port=server.port)
    r.config_set("save", "900 1")
    shutil.rmtree(server.workdir)
    r.bgsave()
    until(lambda: r.info("persistence")["rdb_last_bgsave_status"] == "err", "the snapshot never failed")
    return r


def test_regression_a_delete_redis_refused_with_misconf_left_the_withdrawn_block_loadable(own_redis):
    # UNLINK answered MISCONF (Redis could not save its snapshot): a raw redis-py ResponseError,
    # not a BackendError, so the withdrawal dropped its keys' suppression and the possibly
    # wrong block loaded as good, here and in every replica sharing the Redis.
    keys = keys_for(1)
    with make_store(None, remote_url=own_redis.url) as store:
        store.save(keys, payloads(store, 1, seed=3)).result(10)
        assert store.tier("remote").contains(keys) == [True]
        r = misconf(own_redis)
        store.invalidate(keys).result(10)
        assert store.metrics.events.get("remote_invalidate_failed") == 1
        assert store.lookup(keys) == 0, "the withdrawn block is promised"
        assert load(store, keys)[0] == [False], "the withdrawn block was loaded as good"
        r.config_set("save", "")  # snapshots off: writes accepted again, the retry deletes it
        until(lambda: store.tier("remote").contains(keys) == [False], "the refused delete was never tried again")
    with make_store(None, remote_url=own_redis.url) as replica:
        assert replica.lookup(keys) == 0


def test_regression_a_delete_refused_by_a_read_only_replica_raised_a_raw_redis_error(own_redis, tmp_path):
    master = RedisServer(tmp_path / "master").start()
    try:
        b = open_backend(own_redis.url, timeout="1s", retries=1)
        redis.Redis(port=master.port).set(b"tkv:k", b"v")
        replica = redis.Redis(port=own_redis.port)
        replica.replicaof("127.0.0.1", master.port)
        until(lambda: replica.info("replication").get("master_link_status") == "up", "the replica never synced")
        with pytest.raises(BackendError) as refused:
            b.delete_many([b"k"])
        assert not isinstance(refused.value, BackendUnavailable) and "read only replica" in str(refused.value)
        assert b.put_many([(b"x", b"y")]) == [False]  # a refused put: False, counted
        assert b.get_many([b"k"]) == [b"v"] and b.contains_many([b"k"]) == [True]  # reads still served
        stats = b.stats()
        assert stats.errors == 1 and stats.put_rejected == 1 and b.available
        b.close()
    finally:
        master.stop()


def test_regression_a_key_of_ours_holding_a_list_was_promised_to_every_lookup_and_never_saved_again(own_redis):
    # EXISTS said present for a key someone else made a list: every lookup promised the block,
    # every load of it missed (WRONGTYPE), and no save replaced it (it was "held").
    keys = keys_for(1)
    with make_store(None, remote_url=own_redis.url) as store:
        store.save(keys, payloads(store, 1, seed=3)).result(10)
    r = redis.Redis(port=own_redis.port)
    (name,) = [n for n in r.scan_iter(match=b"tkv:*") if b"tkv-ns" not in n]  # the block (not the namespace record)
    r.delete(name)
    r.rpush(name, b"someone else's")
    with make_store(None, remote_url=own_redis.url) as store:
        assert store.lookup(keys) == 0, "a key holding a list is promised"
        assert load(store, keys)[0] == [False]  # a counted miss, no exception
        store.save(keys, payloads(store, 1, seed=3)).result(10)
    assert r.type(name) == b"string"
    with make_store(None, remote_url=own_redis.url) as replica:
        assert replica.lookup(keys) == 1 and load(replica, keys)[0] == [True]


def test_regression_every_value_refused_was_logged_as_a_warning(own_redis, caplog, monkeypatch):
    # OOM was meant to be a debug line (no room: a counted put_rejected), but redis-py's message
    # drops the "OOM" the level was chosen by: one warning per value; MISCONF one per value too.
    monkeypatch.setattr(redis_remote, "_refusals", LogThrottle(redis_remote.log), raising=False)  # (fresh)
    b = open_backend(own_redis.url)
    r = redis.Redis(port=own_redis.port)
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", "1")
    caplog.set_level(logging.DEBUG, logger="storage_backends.redis_remote")
    assert b.put_many([(b"o%d" % i, b"x" * 100) for i in range(20)]) == [False] * 20
    assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
    r.config_set("maxmemory", "0")
    misconf(own_redis)
    for i in range(20):
        assert b.put_many([(b"m%d" % i, b"x")]) == [False]
    warned = [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
    assert len(warned) == 1 and "MISCONF" in warned[0].getMessage()
    assert b.stats().put_rejected == 40 and b.available
    b.close()


def denied(server: RedisServer, command: str, password: str = "+pw", in_url: str = "pw"):
    """A tier logged in as a user allowed every command but ``command`` (``-info``), holding one
    value ``k``."""
    redis.Redis(port=server.port).acl_setuser("app", enabled=True, passwords=[password], keys=["*"],
                                              commands=["+@all", command])
    b = open_backend(f"redis://app:{in_url}@127.0.0.1:{server.port}/0")
    assert b.put_many([(b"k", b"v")]) == [True]
    return b


def test_stats_of_a_user_denied_info_are_the_counters_not_a_raw_redis_error(own_redis):
    b = denied(own_redis, "-info", "+p@ss/w?rd", "p%40ss%2Fw%3Frd")
    stats = b.stats()
    assert stats.puts == 1 and "no permissions" in stats.extra["unavailable"] and b.available
    assert "p@ss" not in str(stats) and "p%40ss" not in str(stats)
    b.close()


def test_a_user_denied_type_gets_counted_unavailable_lookups_not_every_block_absent(own_redis):
    # presence is asked with TYPE (a key someone made a list is not ours): an ACL that allows
    # EXISTS but not TYPE must not turn into "nothing is stored" with nothing counted
    b = denied(own_redis, "-type")
    with pytest.raises(BackendUnavailable, match="refused TYPE"):
        b.contains_many([b"k"])
    assert b.get_many([b"k"]) == [b"v"]
    b.close()


def test_regression_a_server_answering_no_redis_protocol_raised_an_untyped_error(tmp_path):
    # A URL naming something that is not Redis (an HTTP port, a proxy): redis-py's protocol
    # error came out of delete_many raw, which ended a withdrawal unretried. Now the tier is
    # counted unavailable (its breaker opens: nothing there speaks Redis).
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def answer_http() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    thread = threading.Thread(target=answer_http, daemon=True)
    thread.start()
    b = open_backend(f"redis://127.0.0.1:{listener.getsockname()[1]}/0?retries=0&timeout=2s")
    try:
        with pytest.raises(BackendUnavailable):
            b.delete_many([b"k" * 16])
        assert not b.available
    finally:
        b.close()
        stop.set()
        listener.close()
