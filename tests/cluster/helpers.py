"""What the cluster scenarios share: where a block lives, loads that report instead of raising."""

from __future__ import annotations

import time

import torch
from redis.crc import key_slot

from storage_backends.redis_names import RedisNames
from tests.redis_cluster import SLOTS, Node, RedisClusterServers
from tests.store.helpers import NS, load

PREFIX = b"tkv:"  # the remote tier's default key prefix
LOOKUP_S = 5.0  # stores' lookup deadline here: a new cluster client first learns the topology
# (slower than the 50 ms default on this VM), and these scenarios are not about the deadline


def stored_name(key: bytes, digest: bytes = NS.digest()) -> bytes:
    """The Redis key a block of namespace ``digest`` is stored under."""
    return RedisNames(PREFIX, cluster=True).name(digest + key)


def masters_of(cluster: RedisClusterServers, keys: list[bytes], digest: bytes = NS.digest()) -> dict[int, Node]:
    """Index of each key -> the master serving it now."""
    masters = _settled_masters(cluster)
    out = {}
    for i, key in enumerate(keys):
        slot = key_slot(stored_name(key, digest))
        out[i] = next(m for m, slots in masters.values() if slot in slots)
    return out


def bit_exact_loads(store, keys: list[bytes], expected: list[torch.Tensor]) -> list[bool]:
    """Load ``keys``; every block that loads must equal what was saved."""
    ok, outs = load(store, keys)
    assert all(torch.equal(out, want) for hit, out, want in zip(ok, outs, expected) if hit)
    return ok


def _settled_masters(cluster: RedisClusterServers, deadline_s: float = 10.0) -> dict[int, tuple[Node, set[int]]]:
    """port -> (master, its slots), once the masters' own views cover every slot exactly once
    (right after the cluster forms or fails over, a node's view can lag for a moment)."""
    stop = time.monotonic() + deadline_s
    while True:
        masters = {m.port: (m, cluster.slots_of(m)) for m in cluster.masters()}
        slots = [len(s) for _, s in masters.values()]
        if sum(slots) == SLOTS and len(set().union(*(s for _, s in masters.values()))) == SLOTS:
            return masters
        if time.monotonic() > stop:
            raise AssertionError(f"masters' slot views never settled: {sorted(slots)}")
        time.sleep(0.05)


def failed_over(cluster: RedisClusterServers, victim: Node, deadline_s: float = 30.0) -> None:
    """Kill master ``victim`` once its replicas hold all it has, and return once its replica
    serves its slots and no living node's slot map names it any more (a client reading the
    topology again then finds the promoted replica, whichever node it asks)."""
    cluster.wait_replicated()
    cluster.kill(victim)
    cluster.wait_healthy(deadline_s)
    stop = time.monotonic() + deadline_s
    while any(owner[1] == victim.port for node in cluster.living()
              for _, _, owner, *_ in node.client().execute_command("CLUSTER", "SLOTS")):
        assert time.monotonic() < stop, "a node's slot map still names the killed master"
        time.sleep(0.05)


def put_all(backend, items: list[tuple[bytes, bytes]], guard_s: float = 30.0) -> None:
    """Store ``items`` through ``backend`` (a scenario's setup), again while its first calls time
    out: a backend under test has a timeout of a few hundred ms, and a first connect to a new
    cluster on a loaded CI machine took longer ("Timeout writing to socket"), failing the setup
    of scenarios about something else. Waits for the breaker to close between tries."""
    from tiered_kv.errors import BackendUnavailable

    deadline = time.monotonic() + guard_s  # (a hang guard only)
    while True:
        try:
            assert all(backend.put_many(items))
            return
        except BackendUnavailable:
            assert time.monotonic() < deadline, "the cluster never took the setup's keys"
        while not backend.available and time.monotonic() < deadline:
            time.sleep(0.05)
