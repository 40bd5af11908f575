"""Real Redis Clusters (3 masters + 3 replicas) for the cluster scenarios."""

from __future__ import annotations

import pytest

from tests.redis_cluster import RedisClusterServers, missing_tools


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """One cluster per module, formed once; tests must leave every node alive."""
    if reason := missing_tools():
        pytest.skip(reason)
    cluster = RedisClusterServers(tmp_path_factory.mktemp("cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def own_redis_cluster(tmp_path):
    """A cluster of this test's own, whose nodes the test may kill."""
    if reason := missing_tools():
        pytest.skip(reason)
    cluster = RedisClusterServers(tmp_path / "cluster").start()
    yield cluster
    cluster.stop()
