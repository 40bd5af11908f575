"""Delete-if-unchanged on a real Redis Cluster: keys of one call spread over every master (and
keys of one slot share a script), each deleted only while it holds the value the caller read;
the verify fix then keeps a block a serving client rewrote (storage_backends.cas_redis)."""

from __future__ import annotations

from storage_backends.cas_delete import delete_if_unchanged
from storage_backends.redis_remote import RedisBackend


def test_a_cluster_delete_if_unchanged_keeps_changed_values_on_every_master(redis_cluster):
    with RedisBackend.from_url(redis_cluster.url, pipeline_bytes=64) as b:
        items = [(i.to_bytes(2, "big") * 8, i.to_bytes(2, "big") * 4) for i in range(200)]
        items.append((b"{tag}" + b"x" * 11, b"tagged"))  # (a key that forms a hash tag: behind {})
        assert all(b.put_many(items))
        pairs = [(k, v if i % 3 else b"not this") for i, (k, v) in enumerate(items)]
        done = delete_if_unchanged(b, pairs)
        assert done == [bool(i % 3) for i in range(len(items))]
        assert [v is None for v in b.get_many([k for k, _ in items])] == done
        assert b.delete_many([k for k, _ in items]) == len(items) - sum(done)
