"""A Redis whose replies trickle in (a few bytes every few milliseconds: no socket read ever
waits a whole timeout) must not hold a call: every call ends by its deadline
(:mod:`storage_backends.redis_deadline`) as BackendUnavailable, with its connection dropped.
Real redis-server behind a trickling proxy (:mod:`tests.backends.trickle`); the tests gate on
what the proxy delivered and saw, not on the clock. Without the deadline each call here went on
until the whole reply had trickled through (10 s and more) and then succeeded."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest

from storage_backends.registry import open_backend
from tests.backends.trickle import TrickleProxy
from tests.redis_cluster import distinct_free_ports
from tiered_kv.errors import BackendUnavailable

VALUE = bytes(range(256)) * 128  # 32 KiB: 10 s through the trickle (32 bytes every 10 ms)
TIMEOUT = "300ms"


@pytest.fixture
def proxy(redis_server, redis_url):
    p = TrickleProxy(("127.0.0.1", redis_server.port), piece=32, interval=0.01)
    yield p
    p.close()


def _trickled_links(proxy: TrickleProxy) -> list:
    return [link for link in proxy.links if link.delivered]


def _assert_cut_short(proxy: TrickleProxy, reply_bytes: int) -> None:
    """The call ended before its reply came through, and dropped the connection that carried it."""
    links = _trickled_links(proxy)
    assert len(links) == 1 and links[0].delivered < reply_bytes
    assert links[0].client_closed.wait(10), "the half-read connection was kept"


@pytest.mark.parametrize("cluster", [False, True], ids=["standalone", "cluster"])
def test_a_trickled_get_does_not_hold_the_caller_past_its_deadline(request, cluster):
    proxy = request.getfixturevalue("cluster_proxy" if cluster else "proxy")
    b = open_backend(proxy.url, timeout=TIMEOUT, retries=2, cluster=cluster)
    try:
        assert b.put_many([(b"k", VALUE)]) == [True]
        proxy.start_trickling()
        with pytest.raises(BackendUnavailable):
            b.get_many([b"k"])
        _assert_cut_short(proxy, len(VALUE))
        assert not b.available  # the breaker's usual path: open until a probe gets an answer
    finally:
        b.close()


def test_a_trickled_lookup_does_not_hold_the_scheduler(proxy):
    b = open_backend(proxy.url, timeout=TIMEOUT)
    try:
        keys = [b"%08d" % i for i in range(1000)]
        assert b.contains_many(keys[:1]) == [False]  # (connected before the trickle)
        proxy.start_trickling()
        with pytest.raises(BackendUnavailable):
            b.contains_many(keys)  # 1000 "+none" replies: 7 KB
        _assert_cut_short(proxy, 7 * len(keys))
    finally:
        b.close()


def test_a_trickled_scan_page_does_not_hold_the_listing(proxy):
    b = open_backend(proxy.url, timeout=TIMEOUT)
    try:
        assert all(b.put_many([(b"key-%08d" % i, b"v") for i in range(500)]))
        proxy.start_trickling()
        with pytest.raises(BackendUnavailable):
            list(b.scan())  # a page of 500 names: ~10 KB
        _assert_cut_short(proxy, 500 * 16)
    finally:
        b.close()


def test_trickled_figures_come_back_as_unavailable_not_late(proxy):
    b = open_backend(proxy.url, timeout=TIMEOUT)
    try:
        assert b.put_many([(b"k", b"v")]) == [True]
        proxy.start_trickling()
        stats = b.stats()  # INFO: ~5 KB
        assert "unavailable" in stats.extra
        assert len(_trickled_links(proxy)) == 1 and _trickled_links(proxy)[0].client_closed.wait(10)
    finally:
        b.close()


@pytest.mark.parametrize("cluster", [False, True], ids=["standalone", "cluster"])
def test_a_probe_answered_by_a_trickle_keeps_the_breaker_open(request, cluster):
    # the breaker's probe had no deadline: every read of a trickled PONG (and of a cluster's
    # topology) came within the socket timeout, so after seconds the probe closed the breaker on
    # a server no call could finish on, and every caller paid a whole timeout again
    proxy = request.getfixturevalue("cluster_proxy" if cluster else "proxy")
    b = open_backend(proxy.url, timeout=TIMEOUT, retries=0, cluster=cluster)
    try:
        assert b.put_many([(b"k", b"v")]) == [True]
        proxy.piece, proxy.interval = 1, 0.05  # each read gets a byte well within the 300 ms timeout
        proxy.start_trickling()
        with pytest.raises(BackendUnavailable):
            b.get_many([b"k"] * 2000)  # (a reply longer than the deadline allows)
        give_up = time.monotonic() + 30  # (a hang guard only)
        while 0 < b._failures < 4 and time.monotonic() < give_up:
            time.sleep(0.05)
        assert b._failures >= 4, "a probe closed the breaker on a server trickling its replies"
        with pytest.raises(BackendUnavailable, match="is down"):
            b.get_many([b"k"])  # refused at once, no timeout paid
    finally:
        b.close()


@pytest.fixture
def cluster_proxy(tmp_path):
    """A one-node Redis Cluster that announces the proxy's address (every call goes through it)."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server and redis-cli are needed")
    port, bus_port = distinct_free_ports(2)  # (a free port + 10000 may be past 65535)
    proxy = TrickleProxy(("127.0.0.1", port), piece=32, interval=0.01)
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes", "--cluster-port", str(bus_port),
         "--cluster-config-file", str(tmp_path / "nodes.conf"), "--dir", str(tmp_path), "--save", "",
         "--appendonly", "no", "--cluster-announce-ip", "127.0.0.1", "--cluster-announce-port", str(proxy.port),
         "--cluster-announce-bus-port", str(bus_port), "--protected-mode", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _ask(port, "PING", b"+PONG")
        _ask(port, "CLUSTER ADDSLOTSRANGE 0 16383", b"+OK")
        _ask(port, "CLUSTER INFO", b"cluster_state:ok")
        yield proxy
    finally:
        proxy.close()
        proc.kill()
        proc.wait(timeout=10)


def _ask(port: int, command: str, expect: bytes, deadline_s: float = 10.0) -> None:
    """Send ``command`` until its reply holds ``expect`` (the server starting, the cluster forming)."""
    give_up = time.monotonic() + deadline_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(command.encode() + b"\r\n")
                if expect in s.recv(4096):
                    return
        except OSError:
            pass
        assert time.monotonic() < give_up, f"redis did not answer {command!r} with {expect!r}"
        time.sleep(0.05)
