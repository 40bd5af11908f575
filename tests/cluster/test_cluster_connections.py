"""A Redis Cluster tier's connection cap per node is not the cluster being away (real cluster)."""

from __future__ import annotations

import threading

from storage_backends.registry import open_backend
from tiered_kv.errors import BackendUnavailable


def test_regression_more_callers_than_a_nodes_connections_opened_the_breaker(redis_cluster):
    # each node's pool raised "Too many connections" to a caller finding its connections busy:
    # taken for the cluster down, 156 of 160 calls of 8 threads over 1 connection a node failed
    b = open_backend(redis_cluster.url, max_connections=1, timeout="10s")
    keys = [b"k%d" % i for i in range(32)]
    b.put_many([(k, b"v" * 1000) for k in keys])
    barrier, failures = threading.Barrier(8), []

    def caller() -> None:
        barrier.wait()
        for _ in range(10):
            try:
                assert b.get_many(keys) == [b"v" * 1000] * len(keys)
            except BackendUnavailable as exc:
                failures.append(exc)

    threads = [threading.Thread(target=caller) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == [] and b.available
    b.close()
