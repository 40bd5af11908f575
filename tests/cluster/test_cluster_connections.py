"""A Redis Cluster tier's connection cap per node is not the cluster being away (real cluster)."""

from __future__ import annotations

import pytest

from storage_backends.registry import open_backend
from tests.redis_server import calls_at_once
from tiered_kv.errors import BackendUnavailable


def test_regression_more_callers_than_a_nodes_connections_opened_the_breaker(redis_cluster):
    # each node's pool raised "Too many connections" to a caller finding its connections busy:
    # taken for the cluster down, 156 of 160 calls of 8 threads over 1 connection a node failed
    b = open_backend(redis_cluster.url, max_connections=1, timeout="10s")
    keys = [b"k%d" % i for i in range(32)]
    b.put_many([(k, b"v" * 1000) for k in keys])

    def read_all() -> None:
        assert b.get_many(keys) == [b"v" * 1000] * len(keys)

    failures = calls_at_once(read_all)
    assert failures == [] and b.available
    b.close()


def test_regression_a_nodes_busy_connections_were_taken_for_the_node_gone(redis_cluster, monkeypatch):
    # the pool's "all connections busy" was a ConnectionError, which the node pipelines retry as
    # a node that refused: one call waited for the busy node's connections three times, and read
    # the cluster's topology again twice in between (disconnecting the other nodes' idle ones)
    b = open_backend(redis_cluster.url, max_connections=1, timeout="300ms")
    keys = [b"k%d" % i for i in range(32)]
    b.put_many([(k, b"v") for k in keys])
    pool = b.client.get_redis_connection(b.client.get_primaries()[0]).connection_pool
    waits, topology_reads = [], []
    take, initialize = pool.pool.get, b.client.nodes_manager.initialize
    monkeypatch.setattr(pool.pool, "get", lambda *a, **kw: waits.append(1) or take(*a, **kw))
    monkeypatch.setattr(b.client.nodes_manager, "initialize",
                        lambda *a, **kw: topology_reads.append(1) or initialize(*a, **kw))
    held = pool.get_connection()  # (another caller's call that does not end)
    waits.clear()
    try:
        with pytest.raises(BackendUnavailable, match="connections busy"):
            b.get_many(keys)
        assert (len(waits), topology_reads) == (1, []) and b.available
    finally:
        pool.release(held)
    assert b.get_many(keys) == [b"v"] * len(keys)
    b.close()
