"""Several nodes of a real Redis Cluster fail in one call sent at once (``node_threads``): one
node's only connection busy (another caller holds it), another hung (SIGSTOP), refused (killed)
or busy too. A hung node opens the breaker whatever else failed with it; busy connections alone,
or with a refused node, are this process's own limit: a counted miss, the breaker left closed,
no second wait.

Both nodes' pipelines are in flight before either fails (each waits at a barrier as it asks its
node's pool for a connection; ``MEET_S`` bounds that wait), so every node's error is weighed on
every run, never "not started yet"."""

from __future__ import annotations

import signal
import threading

import pytest

from storage_backends.redis_pool import WaitingPool
from storage_backends.redis_remote import RedisBackend
from tests.cluster.helpers import put_all
from tests.redis_cluster import Node, RedisClusterServers
from tiered_kv.errors import BackendUnavailable

MEET_S = 10.0
BIG = 1 << 30  # pipeline_bytes: every key of a call in one batch


def keys_on(cluster: RedisClusterServers, backend: RedisBackend, node: Node, n: int = 4) -> list[bytes]:
    keys = (b"decide-%d" % i for i in range(100_000))
    return [k for k, _ in zip((k for k in keys if cluster.node_of_key(backend.names.name(k)) is node), range(n))]


def pool_of(backend: RedisBackend, node: Node) -> WaitingPool:
    return backend.client.get_redis_connection(backend.client.get_node(host="127.0.0.1", port=node.port)).connection_pool


def two_masters_stored(cluster: RedisClusterServers, retries: int):
    """A backend on ``cluster`` (one connection a node, every key of a call in one batch) and
    two masters other than the first node, each holding four stored keys: (backend, first,
    second, first's keys, second's keys)."""
    backend = RedisBackend.from_url(cluster.url, max_connections=1, timeout="300ms", retries=retries,
                                    pipeline_bytes=BIG, node_threads=4)
    first, second = [m for m in cluster.masters() if m is not cluster.nodes[0]][:2]
    first_keys, second_keys = keys_on(cluster, backend, first), keys_on(cluster, backend, second)
    put_all(backend, [(k, b"v") for k in first_keys + second_keys])
    return backend, first, second, first_keys, second_keys


def meet_and_count(monkeypatch, pools: list[WaitingPool]) -> dict[int, int]:
    """Each of ``pools`` asked for a connection waits once for the others to be asked too;
    returns port -> times asked."""
    barrier = threading.Barrier(len(pools), timeout=MEET_S)
    asked: dict[int, int] = {}
    take = WaitingPool.get_connection

    def get_connection(pool, *args, **kwargs):
        if pool in pools:
            port = pool.connection_kwargs["port"]
            asked[port] = asked.get(port, 0) + 1
            if asked[port] == 1:
                barrier.wait()
        return take(pool, *args, **kwargs)

    monkeypatch.setattr(WaitingPool, "get_connection", get_connection)
    return asked


@pytest.mark.parametrize("busy_first", [True, False])
def test_regression_a_hung_master_left_the_breaker_closed_when_another_nodes_connections_were_busy_in_that_call(
        own_redis_cluster, monkeypatch, busy_first):
    # the busy node's ConnectionsBusy ranked as an "unexpected" error, before the hung node's
    # timeout: the call was a miss with the breaker closed, and every call touching the hung
    # master waited its timeout again while callers kept the other node's connections busy
    cluster = own_redis_cluster
    backend, busy, hung, busy_keys, hung_keys = two_masters_stored(cluster, retries=0)
    held = pool_of(backend, busy).get_connection()  # (another caller's call, not ending)
    asked = meet_and_count(monkeypatch, [pool_of(backend, busy), pool_of(backend, hung)])
    hung.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(BackendUnavailable, match="unavailable"):
            backend.get_many(busy_keys + hung_keys if busy_first else hung_keys + busy_keys)
        assert not backend.available, "the breaker stayed closed on a hung master"
        assert asked == {busy.port: 1, hung.port: 1}
    finally:
        hung.proc.send_signal(signal.SIGCONT)
        pool_of(backend, busy).release(held)
        backend.close()


@pytest.mark.parametrize("with_it", ["busy", "refused"])
def test_a_busy_node_with_another_busy_or_refused_in_one_call_is_a_counted_miss_waited_once(
        own_redis_cluster, monkeypatch, with_it):
    cluster = own_redis_cluster
    backend, busy, second, busy_keys, second_keys = two_masters_stored(cluster, retries=2)
    pools = [pool_of(backend, busy), pool_of(backend, second)]
    held = [p.get_connection() for p in (pools if with_it == "busy" else pools[:1])]
    asked = meet_and_count(monkeypatch, pools)
    if with_it == "refused":
        cluster.kill(second)
    try:
        with pytest.raises(BackendUnavailable, match="connections busy"):
            backend.get_many(busy_keys + second_keys)
        assert backend.available, "busy connections opened the breaker"
        assert asked[busy.port] == 1, "the busy node's connections were waited for again"
    finally:
        for pool, connection in zip(pools, held):
            pool.release(connection)
        backend.close()
