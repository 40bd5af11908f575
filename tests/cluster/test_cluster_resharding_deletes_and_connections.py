"""Resharding a real Redis Cluster under a running tier: a delete-if-unchanged of keys whose slot
is split mid-migration between its two nodes (storage_backends.cas_redis), and the tier's
connections per node over slot moves and after close() (counted with CLIENT LIST)."""

from __future__ import annotations

from redis.crc import key_slot

from storage_backends.cas_delete import delete_if_unchanged
from storage_backends.redis_remote import RedisBackend
from tests.redis_cluster import Node, RedisClusterServers


def keys_of_one_slot_on(cluster: RedisClusterServers, backend: RedisBackend, node: Node, stem: bytes,
                        n: int) -> list[bytes]:
    """``n`` keys sharing one slot that ``node`` serves now."""
    first = next(k for k in (stem + b"%d" % i for i in range(10_000))
                 if cluster.node_of_key(backend.names.name(k)) is node)
    slot = key_slot(backend.names.name(first))
    return [k for k in (stem + b"%d" % i for i in range(2_000_000)) if key_slot(backend.names.name(k)) == slot][:n]


def named_connections(cluster: RedisClusterServers, name: str) -> dict[int, int]:
    """Per living node, the connections whose client name is ``name``."""
    out = {}
    for node in cluster.living():
        admin = node.client()
        try:
            out[node.port] = sum(1 for c in admin.client_list() if c.get("name") == name)
        finally:
            admin.close()
    return out


def test_regression_a_delete_if_unchanged_of_a_slot_split_mid_migration_failed_and_opened_the_breaker(
        redis_cluster):
    # the keys of one slot share a script; with half of them already MIGRATEd the source node
    # answers that script TRYAGAIN ("Multiple keys request during rehashing of slot"): the call
    # raised BackendUnavailable and opened the breaker, so every load missed for a probe interval
    # on a healthy cluster, and the delete failed again on every try until the migration ended
    cluster = redis_cluster
    backend = RedisBackend.from_url(cluster.url)
    source, target = cluster.masters()[:2]
    keys = keys_of_one_slot_on(cluster, backend, source, b"cas-split-", 4)
    slot = key_slot(backend.names.name(keys[0]))
    assert all(backend.put_many([(k, b"v" + k) for k in keys]))
    cluster.begin_migration(slot, source, target)
    try:
        source.client().execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS",
                                        *(backend.names.name(k) for k in keys[:2]))
        pairs = [(k, b"v" + k if i % 2 == 0 else b"changed") for i, k in enumerate(keys)]
        assert delete_if_unchanged(backend, pairs) == [True, False, True, False]
        assert backend.available and backend.stats().errors == 0
        assert backend.get_many(keys) == [None, b"v" + keys[1], None, b"v" + keys[3]]
    finally:
        cluster.migrate_keys(slot, source, target)
        cluster.end_migration(slot, target)
    assert backend.get_many(keys) == [None, b"v" + keys[1], None, b"v" + keys[3]]  # (MOVED followed)
    backend.close()


def test_regression_closing_a_cluster_tier_left_every_nodes_connections_open(redis_cluster):
    # RedisCluster.close() closes each node's client, whose pool (made by from_url) it does not
    # own: every node's connections stayed open for the life of the process after close()
    cluster = redis_cluster
    name = "tkv-close-check"
    backend = RedisBackend.from_url(f"{cluster.url}?client_name={name}")
    one, other = cluster.masters()[:2]
    keys = [b"conn-%d" % i for i in range(64)]
    assert all(backend.put_many([(k, b"v" + k) for k in keys]))
    moving = keys_of_one_slot_on(cluster, backend, one, b"conn-move-", 2)
    assert all(backend.put_many([(k, b"m" + k) for k in moving]))
    slot = key_slot(backend.names.name(moving[0]))
    for source, target in [(one, other), (other, one)] * 3:  # topology changes: MOVED each time
        cluster.begin_migration(slot, source, target)
        assert cluster.migrate_keys(slot, source, target) == len(moving)
        cluster.end_migration(slot, target)
        assert backend.get_many(keys + moving) == [b"v" + k for k in keys] + [b"m" + k for k in moving]
        assert max(named_connections(cluster, name).values()) <= 1  # one caller: one connection a node
    assert backend.available
    backend.close()
    assert named_connections(cluster, name) == {n.port: 0 for n in cluster.living()}
