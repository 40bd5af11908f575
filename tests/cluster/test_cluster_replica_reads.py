"""Reads spread over a cluster's replicas (``read_from_replicas``): a replica serves loads as
its master would, bit-exact; a Redis that is not a cluster refuses the option at start-up."""

from __future__ import annotations

import pytest

from storage_backends.registry import open_backend
from tests.cluster.helpers import LOOKUP_S, bit_exact_loads
from tests.store.helpers import keys_for, make_store, payloads
from tiered_kv.errors import ConfigError

N = 60


def gets_served(node) -> int:
    stats = node.client().info("commandstats")
    return int(stats.get("cmdstat_get", {}).get("calls", 0))


def test_loads_with_read_from_replicas_are_served_by_replicas_too_and_bit_exact(redis_cluster):
    keys = keys_for(N, first_token=70_000)
    with make_store(host="64KiB", disk=None, remote_url=redis_cluster.url, lookup_timeout=LOOKUP_S) as writer:
        data = payloads(writer, N, seed=5)
        writer.save(keys, data)
        writer.flush()
    redis_cluster.wait_replicated()
    replicas = [r for m in redis_cluster.masters() for r in redis_cluster.replicas_of(m)]
    before = {r.port: gets_served(r) for r in replicas}
    url = redis_cluster.url + "?read_from_replicas=true"
    with make_store(host="64KiB", disk=None, remote_url=url, lookup_timeout=LOOKUP_S) as reader:
        assert all(bit_exact_loads(reader, keys, data))
    served = {r.port: gets_served(r) - before[r.port] for r in replicas}
    assert sum(served.values()) > 0, f"no replica served a GET: {served}"


def test_read_from_replicas_on_a_plain_redis_is_refused_at_start_up(redis_url):
    with pytest.raises(ConfigError, match="read_from_replicas"):
        open_backend(redis_url + "?read_from_replicas=true")
