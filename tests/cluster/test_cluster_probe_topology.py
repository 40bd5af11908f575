"""The breaker's probe on a Redis Cluster reads the topology again before it pings. A startup
node that accepts connections and never answers (a stopped host) must not spend the whole
probe: the other startup nodes are asked too, so a cluster healed by a failover closes the
breaker while that node still hangs. redis-py before 8 asks the startup nodes in a fixed order
(8 shuffles them); the test fixes the order as those versions do."""

from __future__ import annotations

import socket

import pytest
import redis.cluster
from redis.cluster import ClusterNode

from storage_backends.redis_deadline import call_deadline
from storage_backends.redis_remote import RedisBackend

TIMEOUT_S = 0.3


@pytest.fixture
def hung_node():
    """host, port of a listener that completes connects (its backlog) and never answers."""
    server = socket.create_server(("127.0.0.1", 0), backlog=64)
    yield "127.0.0.1", server.getsockname()[1]
    server.close()


def test_regression_a_hung_first_startup_node_spent_the_probe_and_a_healed_cluster_kept_its_breaker_open(
        own_redis_cluster, hung_node, monkeypatch):
    cluster = own_redis_cluster
    backend = RedisBackend.from_url(cluster.url, timeout=f"{int(TIMEOUT_S * 1000)}ms", retries=0)
    try:
        client = backend.client  # the topology as it is now, the master below among its nodes
        victim = cluster.masters()[0]
        cluster.kill(victim)
        cluster.wait_healthy()  # its replica promoted: the cluster is whole again
        host, port = hung_node
        hung = ClusterNode(host, port)
        client.nodes_manager.startup_nodes = {hung.name: hung, **client.nodes_manager.startup_nodes}
        monkeypatch.setattr(redis.cluster.random, "shuffle", lambda nodes: None)  # redis-py < 8's order
        with call_deadline(TIMEOUT_S):  # as the breaker runs its probe
            backend._ping()  # raised: the hung node spent the deadline, the stale topology held the dead master
    finally:
        backend.close()
