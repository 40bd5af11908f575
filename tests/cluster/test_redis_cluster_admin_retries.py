"""Admin calls on a real Redis Cluster: listing keys (SCAN) and the tier's figures (INFO, SCAN)
are retried, with the topology read again, when a node refuses the connection. Since the
cluster client retries nothing (so that a hung node costs GETs and SETs one timeout), they
failed on the first refused connection: a master that failed over since the client read the
topology made ``scan()`` raise and ``stats()`` report the tier unavailable, and opened the
breaker for every call. Timeouts stay unretried."""

from __future__ import annotations

import signal
import time

import pytest

from storage_backends.redis_remote import RedisBackend
from tests.cluster.helpers import failed_over
from tiered_kv.errors import BackendUnavailable

N = 60


def _keys(backend: RedisBackend, cluster) -> list[bytes]:
    keys = [b"admin-%d" % i for i in range(N)]
    assert all(backend.put_many([(k, b"v") for k in keys]))
    assert len({cluster.node_of_key(backend.names.name(k)).port for k in keys}) == 3
    return keys


def test_regression_listing_and_figures_failed_on_the_first_refused_connection_after_a_failover(
        own_redis_cluster):
    cluster = own_redis_cluster
    writer = RedisBackend.from_url(cluster.url)
    keys = _keys(writer, cluster)
    victim = next(m for m in cluster.masters() if m is not cluster.nodes[0])
    lister, counter = RedisBackend.from_url(cluster.url), RedisBackend.from_url(cluster.url)
    try:
        for backend in (lister, counter):  # each learns the topology before the failover
            assert backend.contains_many(keys[:1]) == [True]
        failed_over(cluster, victim)
        assert sorted(lister.scan()) == sorted(keys)
        figures = counter.stats()
        assert "unavailable" not in figures.extra and figures.entries == N
        assert lister.available and counter.available  # the breakers never opened
    finally:
        for backend in (writer, lister, counter):
            backend.close()


def test_a_scan_that_met_a_hung_master_is_not_tried_again(own_redis_cluster, monkeypatch):
    # a timeout is not retried (each try would cost one more): the call fails after one SCAN
    cluster = own_redis_cluster
    writer = RedisBackend.from_url(cluster.url)  # (the keys put with the default timeout: a first
    try:  # connect to a new cluster on a loaded CI machine could take longer than 200 ms)
        _keys(writer, cluster)
    finally:
        writer.close()
    backend = RedisBackend.from_url(cluster.url, timeout="200ms", retries=2)
    deadline = time.monotonic() + 30  # (a hang guard only)
    while True:  # the topology read once with nothing hung: a loaded machine may time a try out
        try:
            if backend.contains_many([b"admin-0"]) == [True] and backend.available:
                break
        except BackendUnavailable:
            pass
        assert time.monotonic() < deadline, "the cluster never answered"
        time.sleep(0.1)
    client, scans = backend.client, []
    real = client.scan
    monkeypatch.setattr(client, "scan", lambda *a, **kw: scans.append(kw.get("target_nodes")) or real(*a, **kw))
    hung = next(m for m in cluster.masters() if m is not cluster.nodes[0])
    hung.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(BackendUnavailable):
            list(backend.scan())
        assert len(scans) == 1
    finally:
        hung.proc.send_signal(signal.SIGCONT)
        backend.close()


def test_an_admin_call_is_tried_again_as_a_whole_on_refusals_but_not_past_retries_nor_on_a_wrong_password(
        monkeypatch):
    # (a loop of our own: the arguments of redis-py's call_with_retry it first used exist only
    # from redis-py 7, and the project supports 5 and 6)
    from redis.backoff import NoBackoff
    from redis.exceptions import AuthenticationError
    from redis.exceptions import ConnectionError as RedisConnectionError

    from storage_backends import redis_admin

    reads = []
    monkeypatch.setattr(redis_admin, "reinitialize", reads.append)

    def failing(*errors):
        left = list(errors)

        def fn(client):
            if left:
                raise left.pop(0)
            return "answer"
        return fn

    retry = redis_admin.AdminRetry(NoBackoff(), 2)
    assert retry.call("client", failing(RedisConnectionError("a"), RedisConnectionError("b"))) == "answer"
    assert reads == ["client", "client"], "the topology is read again before each new try"
    with pytest.raises(RedisConnectionError):
        retry.call("client", failing(*[RedisConnectionError("c")] * 3))
    reads.clear()
    with pytest.raises(AuthenticationError):
        retry.call("client", failing(AuthenticationError("wrong password")))
    assert reads == []
