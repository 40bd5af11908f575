"""Redis tier scenarios against a real redis-server: URLs, TTL, prefixes, a dying server, OOM."""

from __future__ import annotations

import subprocess
import time

import pytest

from storage_backends.registry import open_backend
from tests.redis_server import RedisServer, free_port
from tiered_kv.errors import BackendUnavailable, ConfigError


def test_ttl_expires_blocks(redis_url):
    b = open_backend(redis_url, ttl="200ms")
    b.put_many([(b"k", b"v" * 1000), (b"big", b"w" * (600 << 10))])
    assert b.contains_many([b"k", b"big"]) == [True, True]
    time.sleep(0.4)
    assert b.get_many([b"k", b"big"]) == [None, None]
    b.close()


def test_prefixes_isolate_tenants(redis_url):
    a = open_backend(redis_url, prefix="a:")
    b = open_backend(f"{redis_url}?prefix=b:")
    a.put_many([(b"k", b"from a")])
    assert b.get_many([b"k"]) == [None]
    assert list(a.scan()) == [b"k"] and list(b.scan()) == []
    a.close()
    b.close()


def test_large_and_small_value_batches_round_trip(redis_url):
    b = open_backend(redis_url)
    items = [(bytes([i]), bytes([i]) * n) for i, n in enumerate([10, 64 << 10, 2 << 20, 100, 700 << 10])]
    assert b.put_many(items) == [True] * 5
    assert b.get_many([k for k, _ in items]) == [v for _, v in items]
    b.close()


def test_killed_redis_fails_fast_and_counted_then_works_again_after_restart(own_redis):
    b = open_backend(own_redis.url, timeout="300ms", retries=1)
    b.put_many([(b"k", b"v")])
    own_redis.stop()
    t0 = time.perf_counter()
    with pytest.raises(BackendUnavailable):
        b.get_many([b"k"])
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(20):  # the breaker is open: no timeouts are spent
        with pytest.raises(BackendUnavailable):
            b.contains_many([b"k"])
    assert time.perf_counter() - t0 < 0.5
    assert first < 5
    own_redis.start()
    deadline = time.monotonic() + 15
    while True:
        try:
            assert b.put_many([(b"k2", b"back")]) == [True]
            break
        except BackendUnavailable:
            assert time.monotonic() < deadline, "the backend never recovered"
            time.sleep(0.2)
    assert b.get_many([b"k2"]) == [b"back"]
    assert b.stats().errors >= 21
    b.close()


def test_maxmemory_reached_refuses_puts_instead_of_raising(tmp_path):
    server = RedisServer(tmp_path / "r", maxmemory="3mb")
    server.start()
    try:
        subprocess.run(["redis-cli", "-p", str(server.port), "config", "set", "maxmemory-policy", "noeviction"],
                       check=True, capture_output=True)
        b = open_backend(server.url)
        results = b.put_many([(bytes([i]), b"x" * (600 << 10)) for i in range(12)])
        results += b.put_many([(b"s" + bytes([i]), b"y" * 1000) for i in range(50)])
        assert True in results and False in results
        assert b.stats().put_rejected == results.count(False)
        b.close()
    finally:
        server.stop()


def test_unix_socket_url(tmp_path):
    sock = tmp_path / "redis.sock"
    proc = subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", str(sock), "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        b = open_backend(f"unix://{sock}?db=0")
        assert b.put_many([(b"k", b"v")]) == [True]
        assert b.get_many([b"k"]) == [b"v"]
        b.close()
    finally:
        proc.kill()
        proc.wait()


def test_url_options_and_errors():
    b = open_backend(f"redis://127.0.0.1:{free_port()}/0?prefix=x:&ttl=1h&timeout=100ms&retries=0")
    assert b.prefix == b"x:" and b.ttl_ms == 3_600_000
    with pytest.raises(BackendUnavailable):
        b.get_many([b"k"])  # nothing listens there
    b.close()
    with pytest.raises(ConfigError, match="unknown redis option"):
        open_backend("redis://127.0.0.1:1/0", colour="red")
    tls = open_backend("rediss://127.0.0.1:1/0?ssl_cert_reqs=none")
    assert tls.client.connection_pool.connection_kwargs.get("ssl_cert_reqs") in ("none", None, 0)
    tls.close()
