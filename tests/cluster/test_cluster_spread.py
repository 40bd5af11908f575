"""Blocks of one namespace on a real 3-master Redis Cluster: spread over every master, batched
reads and writes across nodes, the namespace record readable through any node."""

from __future__ import annotations

from collections import Counter

from storage_backends.registry import open_backend
from tests.cluster.helpers import bit_exact_loads, masters_of, stored_name
from tests.store.helpers import NS, keys_for, make_store, payloads
from tiered_kv.store.records import decode_namespace, namespace_key

N = 60


def test_blocks_of_one_namespace_spread_over_every_master(redis_cluster):
    keys = keys_for(N, first_token=10_000)
    with make_store(host="64KiB", disk=None, remote_url=redis_cluster.url) as store:
        store.save(keys, payloads(store, N))
        store.flush()
    where = masters_of(redis_cluster, keys)
    per_master = Counter(m.port for m in where.values())
    assert len(per_master) == 3, f"a namespace pinned to fewer masters: {per_master}"
    for i, master in where.items():  # each block is held by the master the cluster names
        assert master.client().exists(stored_name(keys[i])) == 1
    print(f"spread of {N} blocks over the masters: {sorted(per_master.values())}")


def test_batched_saves_and_loads_across_nodes_are_bit_exact_in_another_replica(redis_cluster, tmp_path):
    keys = keys_for(N, first_token=20_000)
    with make_store(host="64KiB", disk=None, remote_url=redis_cluster.url) as writer:
        data = payloads(writer, N, seed=3)
        writer.save(keys, data)  # one batch, keys of all three masters
        writer.flush()
    with make_store(tmp_path, host="64KiB", remote_url=redis_cluster.url) as replica:  # empty host, disk
        assert replica.locate(keys) == ["remote"] * N
        assert all(bit_exact_loads(replica, keys, data))
        assert replica.metrics.misses("remote_unavailable") == 0


def test_the_namespace_record_is_readable_through_every_node(redis_cluster):
    with make_store(host="64KiB", disk=None, remote_url=redis_cluster.url) as store:
        store.save(keys_for(2, first_token=30_000), payloads(store, 2))
        store.flush()
    record = namespace_key(NS.digest())
    for node in redis_cluster.nodes:  # masters and replicas alike: the client follows MOVED
        backend = open_backend(redis_cluster.url_of(node))
        try:
            [value] = backend.get_many([record])
            assert value is not None and decode_namespace(record, value) == NS
        finally:
            backend.close()
