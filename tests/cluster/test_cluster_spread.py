"""Blocks of one namespace on a real 3-master Redis Cluster: spread over every master, batched
reads and writes across nodes, the namespace record readable through any node."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from storage_backends.registry import open_backend
from tests.cluster.helpers import LOOKUP_S, bit_exact_loads, masters_of, stored_name
from tests.store.helpers import NS, keys_for, make_store, payloads
from tiered_kv.store.records import decode_namespace, namespace_key

N = 60


def test_blocks_of_one_namespace_spread_over_every_master(redis_cluster):
    keys = keys_for(N, first_token=10_000)
    with make_store(host="64KiB", disk=None, remote_url=redis_cluster.url, lookup_timeout=LOOKUP_S) as store:
        store.save(keys, payloads(store, N))
        store.flush()
    where = masters_of(redis_cluster, keys)
    per_master = Counter(m.port for m in where.values())
    assert len(per_master) == 3, f"a namespace pinned to fewer masters: {per_master}"
    for i, master in where.items():  # each block is held by the master the cluster names
        assert master.client().exists(stored_name(keys[i])) == 1
    print(f"spread of {N} blocks over the masters: {sorted(per_master.values())}")


def _tagged_namespace():
    """A namespace whose digest holds a Redis hash tag (a ``{``, then a ``}`` further on)."""
    for i in range(100_000):
        ns = replace(NS, model_id=f"tagged-{i}")
        d = ns.digest()
        start = d.find(b"{")
        if start >= 0 and d.find(b"}", start + 2) >= 0:
            return ns
    raise AssertionError("no tagged digest found")


def test_a_namespace_whose_digest_forms_a_hash_tag_still_spreads_over_every_master(redis_cluster):
    ns = _tagged_namespace()
    keys = keys_for(N, ns, first_token=40_000)
    with make_store(ns=ns, host="64KiB", disk=None, remote_url=redis_cluster.url, lookup_timeout=LOOKUP_S) as store:
        data = payloads(store, N, seed=7)
        store.save(keys, data)
        store.flush()
        where = masters_of(redis_cluster, keys, ns.digest())
        assert len({m.port for m in where.values()}) == 3, "the namespace is pinned to one slot"
        for i, master in where.items():
            assert master.client().exists(stored_name(keys[i], ns.digest())) == 1
        remote = store.tier("remote").backend
        assert sorted(k for k in remote.scan(ns.digest())) == sorted(ns.digest() + k for k in keys)
    with make_store(ns=ns, host="64KiB", disk=None, remote_url=redis_cluster.url, lookup_timeout=LOOKUP_S) as reader:
        assert all(bit_exact_loads(reader, keys, data))


def test_batched_saves_and_loads_across_nodes_are_bit_exact_in_another_replica(redis_cluster, tmp_path):
    keys = keys_for(N, first_token=20_000)
    with make_store(host="64KiB", disk=None, remote_url=redis_cluster.url, lookup_timeout=LOOKUP_S) as writer:
        data = payloads(writer, N, seed=3)
        writer.save(keys, data)  # one batch, keys of all three masters
        writer.flush()
    with make_store(tmp_path, host="64KiB", remote_url=redis_cluster.url, lookup_timeout=LOOKUP_S) as replica:  # empty host, disk
        assert replica.locate(keys) == ["remote"] * N
        assert all(bit_exact_loads(replica, keys, data))
        assert replica.metrics.misses("remote_unavailable") == 0


def test_the_namespace_record_is_readable_through_every_node(redis_cluster):
    with make_store(host="64KiB", disk=None, remote_url=redis_cluster.url, lookup_timeout=LOOKUP_S) as store:
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
