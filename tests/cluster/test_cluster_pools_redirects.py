"""Calls whose keys a resharding redirects (ASK mid-migration, MOVED after it) on a real Redis
Cluster with one connection per node: a thread following them holds one node's connection at a
time, so two calls redirected across the same two nodes in opposite orders never wait out each
other's ``timeout`` on a healthy cluster.

The evidence is structural: every connection a thread takes from a node's pool is recorded with
the connections it already held. A thread asking one node's pool while it holds another's meets
the other caller at a barrier first (``MEET_S`` bounds that wait), so the crossed waits the old
code could fall into happen on every run, not by chance."""

from __future__ import annotations

import signal
import threading

import pytest
from redis.crc import key_slot

from storage_backends.redis_pool import WaitingPool
from storage_backends.redis_remote import RedisBackend
from tests.cluster.helpers import put_all
from tests.redis_cluster import Node, RedisClusterServers
from tiered_kv.errors import BackendUnavailable

MEET_S = 10.0


class Holdings:
    """Per thread, the node pools whose connections it holds; ``crossed``: each time a thread
    asked a pool for a connection while holding another node's (it then waits at ``barrier``)."""

    def __init__(self, monkeypatch, meet: int) -> None:
        self.barrier = threading.Barrier(meet, timeout=MEET_S)
        self.crossed: list[tuple[str, int, list[int]]] = []
        self._held: dict[int, list[WaitingPool]] = {}
        take, give = WaitingPool.get_connection, WaitingPool.release

        def get_connection(pool, *args, **kwargs):
            mine = self._held.setdefault(threading.get_ident(), [])
            others = [p.connection_kwargs["port"] for p in mine if p is not pool]
            if others:
                self.crossed.append((threading.current_thread().name, pool.connection_kwargs["port"], others))
                try:
                    self.barrier.wait()  # the other caller holds its first node's connection too
                except threading.BrokenBarrierError:
                    pass
            connection = take(pool, *args, **kwargs)
            mine.append(pool)
            return connection

        def release(pool, connection):
            mine = self._held.get(threading.get_ident(), [])
            if pool in mine:
                mine.remove(pool)
            return give(pool, connection)

        monkeypatch.setattr(WaitingPool, "get_connection", get_connection)
        monkeypatch.setattr(WaitingPool, "release", release)


def key_on(cluster: RedisClusterServers, backend: RedisBackend, node: Node, stem: bytes) -> bytes:
    """A key whose slot ``node`` serves now."""
    return next(k for k in (stem + b"%d" % i for i in range(10_000))
                if cluster.node_of_key(backend.names.name(k)) is node)


def swap_slots(cluster: RedisClusterServers, backend: RedisBackend, a: bytes, b: bytes,
               one: Node, other: Node, *, end: bool) -> list[tuple[int, Node]]:
    """Migrate ``a``'s slot from ``one`` to ``other`` and ``b``'s the other way, keys and all;
    ``end``: the slots then belong to their new owners (MOVED), else they stay migrating (ASK).
    Returns (slot, new owner) to end the migrations with."""
    moves = [(key_slot(backend.names.name(a)), one, other), (key_slot(backend.names.name(b)), other, one)]
    for slot, source, target in moves:
        cluster.begin_migration(slot, source, target)
        assert cluster.migrate_keys(slot, source, target) >= 1
    if end:
        for slot, _, target in moves:
            cluster.end_migration(slot, target)
    return [(slot, target) for slot, _, target in moves]


@pytest.mark.parametrize("node_threads", [0, 4])
@pytest.mark.parametrize("stage", ["migrating", "migrated"])
def test_regression_two_calls_redirected_across_two_nodes_in_opposite_orders_waited_out_each_others_connections(
        redis_cluster, monkeypatch, stage, node_threads):
    # redis-py's cluster pipeline, which followed ASK and MOVED, took a connection of every node
    # of its commands at once, in its commands' order: one call held node A's only connection
    # waiting for B's while the other held B's waiting for A's; both waited the full timeout and
    # at least one was a counted miss (172 of 2,000 such calls on a healthy cluster)
    cluster = redis_cluster
    backend = RedisBackend.from_url(cluster.url, max_connections=1, timeout="1s", retries=0, node_threads=node_threads)
    one, other = cluster.masters()[:2]
    stem = b"%s-%d-" % (stage.encode(), node_threads)
    a, b = key_on(cluster, backend, one, stem + b"a"), key_on(cluster, backend, other, stem + b"b")
    value = {a: b"A" * 100, b: b"B" * 100}
    assert all(backend.put_many(list(value.items())))  # (the backend learns the slots' owners now)
    ends = swap_slots(cluster, backend, a, b, one, other, end=stage == "migrated")
    holdings = Holdings(monkeypatch, meet=2)
    got: dict[str, list] = {}
    failures: list[Exception] = []

    def load(name: str, keys: list[bytes]) -> None:
        try:
            got[name] = backend.get_many(keys)
        except Exception as exc:  # (kept: the test says what it expected)
            failures.append(exc)

    callers = [threading.Thread(target=load, args=("ab", [a, b])), threading.Thread(target=load, args=("ba", [b, a]))]
    try:
        for t in callers:
            t.start()
        for t in callers:
            t.join()
        assert failures == [] and got == {"ab": [value[a], value[b]], "ba": [value[b], value[a]]}
        assert holdings.crossed == [], "a thread waited for a node's connection while holding another's"
        assert backend.available and backend.stats().errors == 0
    finally:
        if stage == "migrating":
            for slot, target in ends:
                cluster.end_migration(slot, target)
        backend.close()


def test_a_save_into_a_migrating_slot_lands_on_the_importing_node_behind_asking(redis_cluster):
    # a key the migrating node does not hold is answered ASK; the SET goes to the importing
    # node behind ASKING (without it that node answers MOVED back), and stays there
    cluster = redis_cluster
    backend = RedisBackend.from_url(cluster.url)
    one, other = cluster.masters()[:2]
    a, b = key_on(cluster, backend, one, b"save-a"), key_on(cluster, backend, other, b"save-b")
    assert all(backend.put_many([(a, b"old a"), (b, b"old b")]))
    ends = swap_slots(cluster, backend, a, b, one, other, end=False)
    fresh = next(k for k in (b"save-new%d" % i for i in range(1_000_000))
                 if key_slot(backend.names.name(k)) == key_slot(backend.names.name(a)))
    try:
        assert backend.put_many([(fresh, b"new"), (a, b"new a")]) == [True, True]
        assert backend.get_many([fresh, a, b]) == [b"new", b"new a", b"old b"]
        for slot, target in ends:
            cluster.end_migration(slot, target)
        assert other.client().get(backend.names.name(fresh)) == b"new"
        assert one.client().execute_command("CLUSTER", "COUNTKEYSINSLOT", key_slot(backend.names.name(a))) == 0
        assert backend.get_many([fresh, a, b]) == [b"new", b"new a", b"old b"]  # MOVED followed too
    finally:
        backend.close()


def test_regression_keys_asked_to_a_hung_importing_node_cost_a_timeout_each(own_redis_cluster, monkeypatch):
    # redis-py's cluster pipeline sent the ASK-redirected commands to the importing node, timed
    # out, then sent each of them again one at a time, each waiting its own timeout: 8 keys of a
    # migrating slot whose importing node hung took 2.3 s at a 300 ms timeout; now one pipeline
    # on that node, one timeout, and the breaker opens
    cluster = own_redis_cluster
    backend = RedisBackend.from_url(cluster.url, timeout="300ms", retries=2)
    source, target = [m for m in cluster.masters() if m is not cluster.nodes[0]][:2]
    slot = key_slot(backend.names.name(key_on(cluster, backend, source, b"hung-")))
    keys = [k for k in (b"hung-%d" % i for i in range(1_000_000)) if key_slot(backend.names.name(k)) == slot][:8]
    put_all(backend, [(k, b"v" + k) for k in keys])
    cluster.begin_migration(slot, source, target)
    cluster.migrate_keys(slot, source, target)
    assert backend.get_many(keys) == [b"v" + k for k in keys]  # (ASK followed while it answers)
    asked: list[int] = []
    take = WaitingPool.get_connection
    monkeypatch.setattr(WaitingPool, "get_connection",
                        lambda pool, *a, **kw: asked.append(pool.connection_kwargs["port"]) or take(pool, *a, **kw))
    target.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(BackendUnavailable, match="unavailable"):
            backend.get_many(keys)
        assert asked.count(target.port) == 1, "the hung node was asked again, a timeout each time"
        assert not backend.available
    finally:
        target.proc.send_signal(signal.SIGCONT)
        backend.close()
