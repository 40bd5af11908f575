"""What the cluster scenarios share: where a block lives, loads that report instead of raising."""

from __future__ import annotations

import torch
from redis.crc import key_slot

from tests.redis_cluster import Node, RedisClusterServers
from tests.store.helpers import NS, load

PREFIX = b"tkv:"  # the remote tier's default key prefix


def stored_name(key: bytes, digest: bytes = NS.digest()) -> bytes:
    """The Redis key a block of namespace ``digest`` is stored under."""
    return PREFIX + digest + key


def masters_of(cluster: RedisClusterServers, keys: list[bytes]) -> dict[int, Node]:
    """Index of each key -> the master serving it now."""
    masters = {m.port: (m, cluster.slots_of(m)) for m in cluster.masters()}
    out = {}
    for i, key in enumerate(keys):
        slot = key_slot(stored_name(key))
        out[i] = next(m for m, slots in masters.values() if slot in slots)
    return out


def bit_exact_loads(store, keys: list[bytes], expected: list[torch.Tensor]) -> list[bool]:
    """Load ``keys``; every block that loads must equal what was saved."""
    ok, outs = load(store, keys)
    assert all(torch.equal(out, want) for hit, out, want in zip(ok, outs, expected) if hit)
    return ok
