"""Redis tier when Redis misbehaves (real servers, no mocks): killed, restarted, hung, full."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import redis

from storage_backends.redis_breaker import COOLDOWN_MAX
from storage_backends.registry import open_backend
from tests.redis_server import RedisServer
from tiered_kv.errors import BackendError, BackendUnavailable


def wait_until_served(backend, deadline_s: float = 15.0) -> float:
    """Seconds until ``backend`` stores a value again (BackendUnavailable meanwhile)."""
    t0 = time.monotonic()
    while True:
        try:
            if backend.put_many([(b"back", b"again")]) == [True]:
                return time.monotonic() - t0
        except BackendUnavailable:
            pass
        assert time.monotonic() - t0 < deadline_s, "the backend never recovered"
        time.sleep(0.05)


def counted_connects(monkeypatch) -> dict[int, list[str]]:
    """thread id -> how each connect that thread made ended ("refused", "timeout", "connected"),
    for every thread but the breaker's background probe (which may connect: it is no caller)."""
    made: dict[int, list[str]] = {}
    connect = redis.connection.Connection._connect

    def counted_connect(conn):
        if threading.current_thread().name == "tiered-kv-redis-probe":
            return connect(conn)
        ended = made.setdefault(threading.get_ident(), [])
        try:
            sock = connect(conn)
        except ConnectionRefusedError:
            ended.append("refused")
            raise
        except OSError as exc:  # (socket.timeout is a TimeoutError, an OSError)
            ended.append("timeout" if isinstance(exc, TimeoutError) else repr(exc))
            raise
        ended.append("connected")
        return sock

    monkeypatch.setattr(redis.connection.Connection, "_connect", counted_connect)
    return made


def test_killed_redis_fails_fast_is_counted_and_the_same_object_recovers(own_redis, monkeypatch):
    b = open_backend(own_redis.url, timeout="300ms", retries=1)
    assert b.put_many([(b"k", b"v"), (b"big", b"w" * (2 << 20))]) == [True, True]
    own_redis.stop()  # SIGKILL, mid-test
    made = counted_connects(monkeypatch)
    with pytest.raises(BackendUnavailable):
        b.get_many([b"k"])
    # connection refused, retried (with backoff) at most ``retries`` times: what the call did,
    # not how long it took
    mine = made.get(threading.get_ident(), [])
    assert 1 <= len(mine) <= 1 + b.retries and set(mine) == {"refused"}, mine
    monkeypatch.undo()
    callers_connecting = []  # (the breaker's background probe may connect: not a caller)
    connect = redis.connection.Connection._connect
    me = threading.get_ident()

    def counted_connect(conn):
        if threading.get_ident() == me:
            callers_connecting.append(conn)
        return connect(conn)

    monkeypatch.setattr(redis.connection.Connection, "_connect", counted_connect)
    for call in [lambda: b.get_many([b"k"]), lambda: b.put_many([(b"x", b"y")]), lambda: b.contains_many([b"k"]),
                 lambda: b.delete_many([b"k"]), lambda: list(b.scan())] * 12:
        with pytest.raises(BackendUnavailable):
            call()
    assert callers_connecting == []  # the breaker is open: no caller spends time on Redis
    monkeypatch.undo()
    stats = b.stats()  # counters still come back, one more error counted
    assert stats.errors == 62 and "unavailable" in stats.extra and stats.puts == 2
    assert b._breaker._prober is not None and b._breaker.next_probe_s() <= COOLDOWN_MAX  # it pings again soon
    own_redis.restart()
    wait_until_served(b)  # by the background probe, on its own
    assert b.get_many([b"back", b"k"]) == [b"again", None]  # a new, empty server
    assert b.stats().errors >= 62  # and those refused while it came back
    b.close()


def test_a_restart_between_calls_is_invisible(own_redis):
    b = open_backend(own_redis.url, retries=1)
    assert b.put_many([(b"k", b"v")]) == [True]
    own_redis.restart()  # the pooled connection is now dead; it is replaced, not reported
    assert b.put_many([(b"k", b"v2")]) == [True]
    assert b.get_many([b"k"]) == [b"v2"] and b.stats().errors == 0
    b.close()


def test_hung_redis_costs_one_timeout_then_every_call_fails_at_once_while_a_background_probe_waits(own_redis,
                                                                                                 monkeypatch):
    b = open_backend(own_redis.url, timeout="400ms", retries=2)
    assert b.put_many([(b"k", b"v")]) == [True]
    # what callers send to Redis is counted, not how long they take: a loaded machine may stall
    # any call longer than a timeout, while a caller that waits on Redis at all must send to it
    sent_by_caller = []
    send = redis.connection.Connection.send_packed_command
    me = threading.get_ident()

    def counted_send(conn, *args, **kwargs):
        if threading.get_ident() == me:  # (the breaker's background probe sends too: not a caller)
            sent_by_caller.append(args[0] if args else None)
        return send(conn, *args, **kwargs)

    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counted_send)
    own_redis.proc.send_signal(signal.SIGSTOP)  # black-holed: accepts connections, never answers
    try:
        with pytest.raises(BackendUnavailable):
            b.get_many([b"k"])
        assert len(sent_by_caller) == 1, sent_by_caller  # one timeout: a timeout is not retried
        probes = b._failures
        deadline = time.monotonic() + 30  # (a hang guard only)
        while b._failures < probes + 2:  # past two cool-downs: no caller is ever made the probe
            assert time.monotonic() < deadline, "the background probe never pinged"
            with pytest.raises(BackendUnavailable):
                b.contains_many([b"k"])
            time.sleep(0.05)
        assert len(sent_by_caller) == 1, sent_by_caller  # a caller made the probe would wait out a timeout
        assert b._breaker._prober is not None and b._breaker._prober.is_alive()  # the one probe, in the background
    finally:
        own_redis.proc.send_signal(signal.SIGCONT)
        monkeypatch.undo()
    deadline = time.monotonic() + 10
    while b._failures and time.monotonic() < deadline:  # the probe closes the breaker by itself
        time.sleep(0.05)
    assert b._failures == 0
    assert b.get_many([b"k"]) == [b"v"]  # the same server, data intact
    b.close()


def test_many_threads_during_an_outage_all_get_backend_unavailable(own_redis, monkeypatch):
    b = open_backend(own_redis.url, timeout="200ms", retries=0)
    b.put_many([(b"k", b"v")])
    own_redis.stop()
    made = counted_connects(monkeypatch)
    outcomes: list[str] = []

    def work() -> None:
        for _ in range(25):
            try:
                b.get_many([b"k"])
                outcomes.append("served")
            except BackendUnavailable:
                outcomes.append("unavailable")
            except Exception as exc:  # anything else is a bug
                outcomes.append(repr(exc))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)  # (a hang guard only)
    assert outcomes == ["unavailable"] * 100
    # fast because of what they did, not timed: a thread's first call may find the breaker still
    # closed and be refused once (retries=0); every later call fails at once, unsent
    assert set(made) <= {t.ident for t in threads} and all(ended == ["refused"] for ended in made.values()), made
    assert b.stats().errors == 101
    b.close()


def test_maxmemory_noeviction_refuses_puts_instead_of_raising(tmp_path):
    server = RedisServer(tmp_path / "r", maxmemory="4mb").start()
    try:
        redis.Redis(port=server.port).config_set("maxmemory-policy", "noeviction")
        b = open_backend(server.url)
        results = b.put_many([(bytes([i]), b"x" * (600 << 10)) for i in range(12)])  # pipelined
        results += [b.put_many([(b"L", b"z" * (5 << 20))])[0]]  # a lone SET
        results += b.put_many([(b"s" + bytes([i]), b"y" * 1000) for i in range(50)])
        assert True in results and False in results and results[12] is False
        stats = b.stats()
        assert stats.put_rejected == results.count(False) and stats.puts == results.count(True)
        assert stats.errors == 0 and stats.extra["maxmemory_policy"] == "noeviction"
        assert b.get_many([bytes([0])]) == [b"x" * (600 << 10)]  # what was stored is still served
        b.close()
    finally:
        server.stop()


def test_maxmemory_with_lru_policy_evicts_on_the_server(tmp_path):
    server = RedisServer(tmp_path / "r", maxmemory="4mb").start()  # allkeys-lru
    try:
        b = open_backend(server.url)
        for i in range(16):
            assert b.put_many([(bytes([i]), b"x" * (512 << 10))]) == [True]
        present = b.contains_many([bytes([i]) for i in range(16)])
        assert present[-1] and not all(present)
        stats = b.stats()
        assert stats.extra["server_evicted_keys"] > 0 and stats.capacity_bytes == 4 << 20
        b.close()
    finally:
        server.stop()


def test_keys_a_delete_failing_part_way_removed_are_announced(own_redis):
    """delete_many UNLINKs KEYS_PER_CALL keys a call: when a later call fails, the keys the
    earlier ones deleted are gone from Redis and must be announced removed (they used to be told
    only after the last call: a router kept routing to them). The server itself refuses the
    second call: a user whose ACL covers the first call's keys only."""
    from storage_backends.redis_remote import KEYS_PER_CALL

    writer = open_backend(own_redis.url)
    ours = [b"a%06d" % i for i in range(KEYS_PER_CALL)]  # the first UNLINK
    theirs = [b"b%06d" % i for i in range(10)]  # the second, refused (NOPERM)
    assert all(writer.put_many([(k, b"v") for k in ours + theirs]))
    admin = redis.Redis.from_url(own_redis.url)
    admin.execute_command("ACL", "SETUSER", "deleter", "on", ">pw", "~tkv:a*", "+@all")
    admin.close()
    deleter = open_backend(own_redis.url.replace("redis://", "redis://deleter:pw@"), retries=0)
    heard = []
    deleter.listen(lambda change, keys: heard.append((change, list(keys))))
    try:
        with pytest.raises(BackendError, match="no permissions"):  # typed, no raw redis-py error
            deleter.delete_many(ours + theirs)
        present = writer.contains_many(ours + theirs)
        gone = [k for k, there in zip(ours + theirs, present) if not there]
        assert gone == ours
        announced = [k for change, keys in heard if change == "removed" for k in keys]
        assert announced == ours  # and not the keys the refused call left in place
        assert deleter.stats().deletes == len(ours)
    finally:
        deleter.close()
        writer.close()


def test_a_failed_delete_announces_its_keys_only_when_it_was_sent(own_redis):
    b = open_backend(own_redis.url, timeout="300ms", retries=0)
    assert b.put_many([(b"k", b"v")]) == [True]
    heard = []
    b.listen(lambda change, keys: heard.append((change, list(keys))))
    own_redis.stop()
    with pytest.raises(BackendUnavailable):
        b.delete_many([b"k"])  # sent: the UNLINK may have run before the connection went
    assert heard == [("removed", [b"k"])]
    with pytest.raises(BackendUnavailable):
        b.delete_many([b"x"])  # the breaker is open now: refused unsent
    assert heard == [("removed", [b"k"])]
    b.close()
