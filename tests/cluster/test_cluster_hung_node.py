"""A master of a real Redis Cluster stops answering (SIGSTOP: connections open, no replies), as
a black-holed node does. A call touching it costs one timeout, as on a single server, and the
breaker stays open until that master answers again. What callers send to the hung master is
counted, not how long they take; the bounds below are bounds on a hang only."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import redis

from storage_backends.redis_remote import RedisBackend
from tests.cluster.helpers import put_all
from tiered_kv.errors import BackendUnavailable

TIMEOUT_S = 0.2


def sends_by_this_thread(monkeypatch) -> list[int]:
    """The port of each node the calling thread sends a command or pipeline to from now on (the
    breaker's background probe sends too, on its own thread: it is no caller)."""
    sent: list[int] = []
    send = redis.connection.Connection.send_packed_command
    me = threading.get_ident()

    def counted_send(conn, *args, **kwargs):
        if threading.get_ident() == me:
            sent.append(conn.port)
        return send(conn, *args, **kwargs)

    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counted_send)
    return sent


def _stopped(cluster, backend, keys, n):
    """``n`` of ``keys`` served by one master, and that master (stopped by the caller)."""
    node = cluster.node_of_key(backend.names.name(keys[0]))
    mine = [k for k in keys if cluster.node_of_key(backend.names.name(k)) is node][:n]
    assert len(mine) == n
    return node, mine


@pytest.mark.parametrize("retries", [0, 2])
def test_regression_a_hung_cluster_master_cost_a_get_pipeline_a_timeout_per_key_and_retry(
        own_redis_cluster, retries, monkeypatch):
    # redis-py's cluster pipeline retried the timed-out pipeline, then sent each of its commands
    # again one at a time, each with its own timeout: 16 keys took 16+ timeouts (the engine's
    # forward pass waited for all of them)
    cluster = own_redis_cluster
    backend = RedisBackend.from_url(cluster.url, timeout=f"{int(TIMEOUT_S * 1000)}ms", retries=retries)
    keys = [b"k%d" % i for i in range(300)]
    put_all(backend, [(k, b"v") for k in keys])
    node, mine = _stopped(cluster, backend, keys, 16)
    others = [k for k in keys if cluster.node_of_key(backend.names.name(k)) is not node][:16]
    sent = sends_by_this_thread(monkeypatch)
    node.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(BackendUnavailable):
            backend.get_many(mine + others)
        # what was sent to the hung master, not how long it took: one pipeline, whose reply
        # timed out once, and nothing sent again (not 16 x (1 + retries) commands one at a time)
        assert sent.count(node.port) == 1, sent
        del sent[:]
        with pytest.raises(BackendUnavailable):  # the breaker is open: at once, nothing sent
            backend.contains_many(mine)
        assert sent == []
    finally:
        node.proc.send_signal(signal.SIGCONT)
        backend.close()


def test_regression_the_breakers_probe_pinged_a_healthy_node_and_closed_while_the_master_hung(
        own_redis_cluster):
    cluster = own_redis_cluster
    backend = RedisBackend.from_url(cluster.url, timeout=f"{int(TIMEOUT_S * 1000)}ms", retries=0)
    keys = [b"k%d" % i for i in range(50)]
    put_all(backend, [(k, b"v") for k in keys])
    node, mine = _stopped(cluster, backend, keys, 1)
    node.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(BackendUnavailable):
            backend.get_many(mine)
        probes = backend._failures
        deadline = time.monotonic() + 10
        while backend._failures == probes and time.monotonic() < deadline:
            time.sleep(0.05)  # until the probe has pinged once (its first cool-down is 0.5 s)
        assert backend._failures > probes and not backend.available  # still open: that master is hung
    finally:
        node.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 30
    while not backend.available and time.monotonic() < deadline:
        time.sleep(0.05)
    assert backend.available and backend.get_many(mine) == [b"v"]  # closed on its own once it answers
    backend.close()
