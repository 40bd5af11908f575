"""A node of a real Redis Cluster dies mid-run. A master: loads never raise, blocks are counted
``remote_unavailable`` misses while its replica is promoted, and the same store recovers on its
own. A replica: nothing changes.

Today one dead master opens the whole tier's circuit breaker, so during the failover window
every remote block misses, not only the dead master's (the figures are printed)."""

from __future__ import annotations

import logging
import time

from tests.cluster.helpers import LOOKUP_S, bit_exact_loads, masters_of
from tests.store.helpers import keys_for, make_store, payloads

log = logging.getLogger(__name__)

N = 48
DEADLINE_S = 30  # a bound on a hang, not a timing claim


def _saved(cluster, keys):
    with make_store(host="64KiB", disk=None, remote_url=cluster.url, lookup_timeout=LOOKUP_S) as writer:
        data = payloads(writer, len(keys))
        writer.save(keys, data)
        writer.flush()
    cluster.wait_replicated()  # the replicas hold every block before anything is killed
    return data


def test_killed_master_costs_counted_misses_until_its_replica_is_promoted_then_the_tier_recovers(
        own_redis_cluster):
    cluster = own_redis_cluster
    keys = keys_for(N)
    data = _saved(cluster, keys)
    where = masters_of(cluster, keys)
    victim = where[0]
    on_victim = {i for i, m in where.items() if m is victim}
    with make_store(host="16KiB", disk=None, remote_url=cluster.url, lookup_timeout=LOOKUP_S) as reader:
        assert all(bit_exact_loads(reader, keys, data))
        cluster.kill(victim)
        t0 = time.monotonic()
        rounds, worst = 0, 0
        while True:
            ok = bit_exact_loads(reader, keys, data)  # never raises, never a wrong block
            rounds += 1
            missed = {i for i, hit in enumerate(ok) if not hit}
            worst = max(worst, len(missed))
            log.debug("%.2fs: %d misses (%d on the dead master)", time.monotonic() - t0, len(missed),
                      len(missed & on_victim))
            if not missed:
                break
            assert time.monotonic() - t0 < DEADLINE_S, "the tier never recovered"
            time.sleep(0.1)
        recovered = time.monotonic() - t0
        unavailable = reader.metrics.misses("remote_unavailable")
        assert unavailable > 0  # the window was counted
        assert cluster.healthy()
        fresh = keys_for(8, first_token=90_000)  # and new saves land on the promoted replica too
        reader.save(fresh, payloads(reader, 8, seed=9))
        reader.flush()
        assert reader.tier("remote").contains(fresh) == [True] * 8
    print(f"failover: {len(on_victim)} of {N} blocks on the killed master; worst round {worst} "
          f"misses; all {N} loaded again after {recovered:.2f}s ({rounds} rounds); "
          f"remote_unavailable misses counted: {unavailable}")


def test_killed_replica_changes_nothing(own_redis_cluster):
    cluster = own_redis_cluster
    keys = keys_for(N, first_token=60_000)
    data = _saved(cluster, keys)
    with make_store(host="16KiB", disk=None, remote_url=cluster.url, lookup_timeout=LOOKUP_S) as reader:
        assert all(bit_exact_loads(reader, keys, data))
        victim = cluster.replicas_of(masters_of(cluster, keys)[0])[0]
        victim_id = cluster.node_id(victim)
        cluster.kill(victim)
        deadline = time.monotonic() + DEADLINE_S  # (a hang guard only)
        while True:  # until the cluster marks it failed (its node timeout passed), not a set time
            assert all(bit_exact_loads(reader, keys, data))
            if _marked_failed(cluster, victim_id):
                break
            assert time.monotonic() < deadline, "the cluster never marked the killed replica failed"
        assert all(bit_exact_loads(reader, keys, data))
        fresh = keys_for(8, first_token=70_000)
        reader.save(fresh, payloads(reader, 8, seed=4))
        reader.flush()
        assert reader.tier("remote").contains(fresh) == [True] * 8
        assert reader.metrics.misses("remote_unavailable") == 0


def _marked_failed(cluster, node_id: str) -> bool:
    """Whether every living master's view flags ``node_id`` ``fail`` (not only ``fail?``)."""
    for master in cluster.masters():
        nodes = master.client().execute_command("CLUSTER", "NODES")
        text = nodes.decode() if isinstance(nodes, bytes) else nodes
        flags = next((ln.split()[2].split(",") for ln in text.splitlines() if ln.startswith(node_id)), [])
        if "fail" not in flags:
            return False
    return True
