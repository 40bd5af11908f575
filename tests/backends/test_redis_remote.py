"""Redis tier against real redis-servers: URL forms (TCP, unix socket, TLS, cluster), options,
TTL, prefixes, batch shapes, value types, stats, close."""

from __future__ import annotations

import array
import contextlib
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis

import storage_backends.redis_figures as redis_figures
from storage_backends.gathered import Gathered
from storage_backends.redis_packer import PACKER
from storage_backends.registry import open_backend
from tests.redis_server import free_port
from tiered_kv.errors import BackendUnavailable, ConfigError


@contextlib.contextmanager
def spawned_redis(workdir: Path, *args: str, optional: bool = False):
    """A redis-server with extra arguments, ready when its log says so (``optional``: skip the
    test when this build of redis-server cannot start so, e.g. without TLS)."""
    workdir.mkdir(parents=True, exist_ok=True)
    logfile = workdir / "redis.log"
    proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir), "--logfile", str(logfile), *args])
    try:
        deadline = time.monotonic() + 10
        while "ready to accept connections" not in (logfile.read_text().lower() if logfile.exists() else ""):
            if proc.poll() is not None or time.monotonic() > deadline:
                (pytest.skip if optional else pytest.fail)(f"redis-server {' '.join(args)} did not start")
            time.sleep(0.02)
        yield proc
    finally:
        proc.kill()
        proc.wait()


# -- URLs and options ----------------------------------------------------------------------------
def test_url_options_parse_and_keywords_override_the_query():
    url = f"redis://alice:s3cret@127.0.0.1:{free_port()}/2?prefix=x:&ttl=1h&timeout=100ms&retries=0"
    b = open_backend(url + "&max_connections=3&pipeline_bytes=2MiB", prefix="y:")
    pool = b.client.connection_pool
    assert (b.prefix, b.ttl_ms, b.timeout) == (b"y:", 3_600_000, 0.1)
    assert b.pipeline_bytes == 2 << 20
    assert pool.max_connections == 3
    kwargs = pool.connection_kwargs
    assert (kwargs["db"], kwargs["username"], kwargs["password"], kwargs["socket_timeout"]) == (2, "alice", "s3cret", 0.1)
    assert "s3cret" not in b.url and "s3cret" not in repr(b) and "alice:***@" in b.url
    with pytest.raises(BackendUnavailable):
        b.get_many([b"k"])  # nothing listens there
    b.close()
    assert open_backend("redis://127.0.0.1:1/0", ttl=0.25).ttl_ms == 250
    assert open_backend("redis://127.0.0.1:1/0?ttl=0").ttl_ms is None


@pytest.mark.parametrize("bad", [{"colour": "red"}, {"ttl": "soon"}, {"retries": "x"}, {"cluster": "maybe"},
                                 {"timeout": "0"}, {"max_connections": "0"}, {"pipeline_bytes": "lots"}])
def test_bad_options_are_config_errors(bad):
    with pytest.raises(ConfigError):
        open_backend("redis://127.0.0.1:1/0", **bad)


def test_bad_urls_are_config_errors():
    with pytest.raises(ConfigError):
        open_backend("redis://127.0.0.1:notaport/0")
    with pytest.raises(ConfigError):
        open_backend("unix:///tmp/x.sock?cluster=true")


def test_rediss_url_configures_tls_without_connecting():
    b = open_backend("rediss://127.0.0.1:1/0?ssl_cert_reqs=none&ssl_check_hostname=false&prefix=t:")
    pool = b.client.connection_pool
    assert issubclass(pool.connection_class, redis.SSLConnection) and b.prefix == b"t:"
    assert pool.connection_kwargs["ssl_cert_reqs"] == "none"
    b.close()
    tls_cluster = open_backend("rediss://127.0.0.1:1/0?cluster=true")  # (connects on first use)
    assert tls_cluster.cluster and not tls_cluster.takes_gathered  # its own connections: joined values
    tls_cluster.close()


def test_tls_round_trip(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    port = free_port()
    with spawned_redis(tmp_path / "r", "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert),
                       "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no", optional=True):
        b = open_backend(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}")
        items = [(b"small", b"s" * 100), (b"large", bytes(range(256)) * 4096)]
        assert b.put_many(items) == [True, True]
        assert b.get_many([b"small", b"large"]) == [v for _, v in items]
        assert b.takes_gathered and b.put_many([(b"parts", Gathered((b"h" * 300, items[1][1])))]) == [True]
        assert b.get_many([b"parts"]) == [b"h" * 300 + items[1][1]]
        b.close()


def test_unix_socket_url_selects_its_db(tmp_path):
    sock = tmp_path / "redis.sock"
    with spawned_redis(tmp_path / "r", "--port", "0", "--unixsocket", str(sock)):
        b = open_backend(f"unix://{sock}?db=1&prefix=u:")
        assert b.put_many([(b"k", b"v"), (b"big", b"w" * (1 << 20))]) == [True, True]
        assert b.get_many([b"k", b"big"]) == [b"v", b"w" * (1 << 20)]
        assert redis.Redis(unix_socket_path=str(sock), db=1).get(b"u:k") == b"v"
        assert redis.Redis(unix_socket_path=str(sock), db=0).dbsize() == 0
        b.close()


def test_redis_cluster_url(tmp_path):
    port = free_port()
    with spawned_redis(tmp_path / "c", "--port", str(port), "--cluster-port", str(free_port()),
                       "--cluster-enabled", "yes",
                       "--cluster-config-file", str(tmp_path / "c" / "nodes.conf")):
        redis.Redis(port=port).execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        b = open_backend(f"redis+cluster://127.0.0.1:{port}", ttl="1h")
        deadline = time.monotonic() + 10  # a new master waits ~2 s before it serves writes
        while True:
            try:
                if b.put_many([(b"probe", b"p")]) == [True]:
                    break
            except BackendUnavailable:
                pass
            assert time.monotonic() < deadline, "the cluster never became writable"
            time.sleep(0.2)
        items = [(bytes([i]) * 32, bytes([i]) * n) for i, n in enumerate([10, 70_000, 3 << 20, 100])]
        assert b.takes_gathered  # a raw block goes out as its head and its host slot
        assert b.put_many(items[:3] + [(items[3][0], Gathered((b"\3" * 40, b"\3" * 60)))]) == [True] * 4
        keys = [k for k, _ in items]
        assert b.get_many(keys + [b"nope"]) == [v for _, v in items] + [None]
        assert b.contains_many([keys[0], b"nope"]) == [True, False]
        assert sorted(b.scan()) == sorted(keys + [b"probe"])
        assert b.delete_many(keys[:2] + [b"nope"]) == 2
        stats = b.stats()
        assert stats.entries == 3 and stats.extra["cluster"] and stats.extra["server_version"]
        assert 0 < redis.Redis(port=port).pttl(b"tkv:" + keys[2]) <= 3_600_000
        b.close()
        assert open_backend(f"redis://127.0.0.1:{port}?cluster=true").cluster


# -- data ----------------------------------------------------------------------------------------
def test_ttl_expires_small_and_large_values(redis_url):
    """Every value is written with the tier's TTL, set by the same SET that stores it (a large
    value too), so Redis expires each of them within the TTL. Asked of Redis, not waited out:
    the expiry time it reports for each key is set, and within the TTL of when it was written."""
    b = open_backend(redis_url, ttl="200ms")
    raw = redis.Redis.from_url(redis_url)
    written = {b"k": b"v" * 1000, b"j": b"u" * 1000, b"big": b"w" * (3 << 20)}
    before_ms = _server_ms(raw)
    assert b.put_many(list(written.items())) == [True] * 3
    after_ms = _server_ms(raw)
    for key, value in written.items():
        name = b"tkv:" + key
        assert raw.get(name) == value  # (this is the key the value lives under)
        assert 0 < raw.pttl(name) <= 200
        expires_ms = raw.execute_command("PEXPIRETIME", name)  # absolute, on the server's clock
        assert before_ms + 200 <= expires_ms <= after_ms + 200, (key, before_ms, expires_ms, after_ms)
    b.close()
    b = open_backend(redis_url)  # no TTL by default
    b.put_many([(b"k", b"v")])
    assert raw.pttl(b"tkv:k") == -1 and raw.execute_command("PEXPIRETIME", b"tkv:k") == -1
    b.close()


def _server_ms(raw: redis.Redis) -> int:
    """The Redis server's clock, in ms (the clock its expiry times are on)."""
    seconds, micros = raw.time()
    return seconds * 1000 + micros // 1000


def test_prefixes_isolate_tenants_even_with_glob_characters(redis_url):
    a = open_backend(redis_url, prefix="a*[")
    b = open_backend(f"{redis_url}?prefix=ab")
    a.put_many([(b"k", b"from a"), (b"\x00*", b"star")])
    b.put_many([(b"k", b"from b"), (b"x", b"only b")])
    assert a.get_many([b"k", b"x"]) == [b"from a", None]
    assert sorted(a.scan()) == [b"\x00*", b"k"] and sorted(b.scan()) == [b"k", b"x"]
    assert list(a.scan(b"\x00*")) == [b"\x00*"] and list(a.scan(b"\x00?")) == []
    assert a.delete_many([b"k", b"x"]) == 1 and b.get_many([b"k"]) == [b"from b"]
    assert (a.stats().entries, b.stats().entries) == (1, 2)
    a.close()
    b.close()


def test_large_and_small_value_batches_round_trip(redis_url):
    b = open_backend(redis_url)
    small = [(b"s%03d" % i, bytes([i % 251]) * (64 << 10)) for i in range(100)]  # several pipelines
    large = [(b"L%d" % i, bytes([i]) * (2 << 20)) for i in range(6)] + [(b"huge", b"h" * (5 << 20))]
    mixed = [(b"m%d" % i, b"m" * n) for i, n in enumerate([0, 1, 700 << 10, 100, 3 << 20, 10])]
    for items in (small, large, mixed):
        assert b.put_many(items) == [True] * len(items)
    everything = small + large + mixed
    assert b.get_many([k for k, _ in everything]) == [v for _, v in everything]
    stats = b.stats()
    assert stats.puts == len(everything) and stats.hits == len(everything)
    assert stats.bytes_in == stats.bytes_out == sum(len(v) for _, v in everything)
    b.close()


def test_reads_of_mixed_sizes_misses_and_foreign_keys(redis_url):
    b = open_backend(redis_url, pipeline_bytes="1MiB")
    sizes = [100, 3 << 20, 1000, 64 << 10, 2 << 20, 10] * 3
    items = [(b"v%02d" % i, bytes([i]) * n) for i, n in enumerate(sizes)]
    assert b.put_many(items) == [True] * len(items)
    raw = redis.Redis.from_url(redis_url)
    raw.hset(b"tkv:hash", b"field", b"not a string")  # someone else's key under our prefix
    keys = [b"hash", b"nope"] + [k for k, _ in items] + [b"nope2"]
    assert b.get_many(keys) == [None, None] + [v for _, v in items] + [None]
    seen = {}
    found = b.visit_many(keys[::-1], lambda i, view: seen.__setitem__(i, len(view)))
    assert found == [v is not None for v in b.get_many(keys[::-1])]
    assert seen == {len(keys) - 3 - j: n for j, n in enumerate(sizes)}
    b.close()


def test_values_of_any_buffer_type_and_binary_content(redis_url):
    b = open_backend(redis_url)
    halfwords = array.array("H", range(40_000))  # a memoryview of 2-byte items, 80 KB
    items = [(b"crlf", b"\r\n$5\r\n*3\r\n" * 3000), (b"ba", bytearray(b"xy" * 20_000)),
             (b"mv", memoryview(halfwords)), (b"\r\n", b"key with CRLF")]
    assert b.put_many(items) == [True] * 4
    assert b.get_many([k for k, _ in items]) == [bytes(v) for _, v in items]
    b.close()


@pytest.mark.parametrize("sizes", [(344, 2 << 20), (2 << 20, 10), (70_000, 3 << 20), (5, 7, 9), (0, 20_000)])
def test_a_gathered_value_is_stored_as_its_parts_joined(redis_url, sizes):
    b = open_backend(redis_url)
    parts = [os.urandom(n) for n in sizes]
    items = [(b"before", b"b" * 10), (b"parts", Gathered(parts)), (b"after", b"a" * 70_000)]
    assert b.put_many(items) == [True] * 3
    assert b.get_many([b"before", b"parts", b"after"]) == [b"b" * 10, b"".join(parts), b"a" * 70_000]
    assert b.stats().bytes_in == 10 + sum(sizes) + 70_000
    b.close()


def test_the_packer_sends_a_large_part_as_it_is_and_joins_small_ones():
    big = memoryview(bytearray(b"p" * (64 << 10)))
    chunks = PACKER.pack("SET", b"k", Gathered((b"head", big, b"tail")))
    assert b"".join(bytes(c) for c in chunks) == (b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\nhead" % (len(big) + 8)
                                                  + bytes(big) + b"tail\r\n")
    assert any(isinstance(c, memoryview) and c.obj is big.obj for c in chunks)  # not copied


def test_stats_report_server_figures(redis_url):
    b = open_backend(redis_url)
    b.put_many([(b"k%d" % i, b"v" * 5000) for i in range(10)])
    stats = b.stats()
    assert stats.entries == 10 and stats.extra["entries_exact"]
    assert stats.capacity_bytes == 512 << 20  # the fixture's maxmemory
    assert stats.used_bytes >= 50_000
    assert stats.extra["maxmemory_policy"] == "allkeys-lru" and stats.extra["hiredis"] is True
    assert stats.extra["server_version"].count(".") == 2
    b.close()


def test_stats_estimate_entries_past_the_sample(redis_url, monkeypatch):
    monkeypatch.setattr(redis_figures, "ENTRY_SAMPLE", 100)
    ours, theirs = open_backend(redis_url, prefix="ours:"), open_backend(redis_url, prefix="theirs:")
    ours.put_many([(b"%d" % i, b"v") for i in range(300)])
    theirs.put_many([(b"%d" % i, b"v") for i in range(300)])
    stats = ours.stats()
    assert not stats.extra["entries_exact"] and stats.extra["server_keys"] == 600
    assert 100 <= stats.entries <= 500
    ours.close()
    theirs.close()


def test_missing_hiredis_is_warned_about(monkeypatch, caplog):
    monkeypatch.setattr(redis.utils, "HIREDIS_AVAILABLE", False)
    with caplog.at_level(logging.WARNING, logger="storage_backends.redis_remote"):
        open_backend("redis://127.0.0.1:1/0").close()
    assert "hiredis" in caplog.text


def test_close_is_idempotent_disconnects_and_refuses_further_calls(redis_url):
    raw = redis.Redis.from_url(redis_url)
    b = open_backend(redis_url)
    b.put_many([(b"k", b"v")])
    ours = str(b.client.client_id())  # the pool's one connection
    assert ours in {c["id"] for c in raw.client_list()}
    b.close()
    b.close()
    deadline = time.monotonic() + 2
    while ours in {c["id"] for c in raw.client_list()}:
        assert time.monotonic() < deadline, "close() left a connection open"
        time.sleep(0.02)
    with pytest.raises(ValueError):
        b.get_many([b"k"])
    raw.close()
