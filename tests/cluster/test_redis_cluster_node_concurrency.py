"""With ``node_threads``, a call spanning several masters of a real Redis Cluster sends their
pipelines at once: its latency was the sum over the nodes (one pipeline after another), now it
is its slowest node's. Without (the default), they go one after another on the caller's thread.

The evidence is structural, not a stopwatch: each node's pipeline waits (at a barrier) until the
call's other pipelines are in flight too, which they only ever are when sent at once; the threads
that sent them are recorded. ``MEET_S`` bounds a hang: met in milliseconds when the pipelines run
at once, never when they run one after another."""

from __future__ import annotations

import signal
import threading

import pytest
from redis.client import Pipeline
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from storage_backends.redis_node_pipelines import THREAD_PREFIX, NodeFanout, node_pipelines
from storage_backends.redis_remote import RedisBackend
from tests.cluster.helpers import failed_over, put_all
from tests.redis_cluster import Node, RedisClusterServers
from tiered_kv.errors import BackendUnavailable

MEET_S = 10.0
BIG = 1 << 30  # pipeline_bytes: every key of a call in one batch (the first GETs are sized by a 2 MiB guess)


class PipelineSpy:
    """Records every per-node pipeline (redis-py's plain ``Pipeline``, redirected passes
    included): its node's port, the thread that sent it, whether it answered. With ``meet``, a pipeline is sent only once ``meet`` of them are in flight."""

    def __init__(self, monkeypatch, meet: int | None = None) -> None:
        self.barrier = threading.Barrier(meet, timeout=MEET_S) if meet else None
        self.broken = False  # a pipeline waited for the others in vain
        self.runs: list[tuple[int, threading.Thread]] = []
        self.answered: list[int] = []
        self.in_flight = 0
        self._lock = threading.Lock()
        real = Pipeline.execute

        def execute(pipe, *args, **kwargs):
            with self._lock:
                self.runs.append((pipe.connection_pool.connection_kwargs["port"], threading.current_thread()))
                self.in_flight += 1
            try:
                if self.barrier is not None:
                    try:
                        self.barrier.wait()
                    except threading.BrokenBarrierError:
                        self.broken = True
                replies = real(pipe, *args, **kwargs)
                with self._lock:
                    self.answered.append(pipe.connection_pool.connection_kwargs["port"])
                return replies
            finally:
                with self._lock:
                    self.in_flight -= 1

        monkeypatch.setattr(Pipeline, "execute", execute)

    @property
    def ports(self) -> list[int]:
        return [port for port, _ in self.runs]

    @property
    def threads(self) -> list[threading.Thread]:
        return [thread for _, thread in self.runs]


def spread(cluster: RedisClusterServers, backend: RedisBackend, stem: bytes, per_master: int = 4
           ) -> tuple[dict[int, list[bytes]], list[bytes]]:
    """``per_master`` keys on each master (port -> keys) and all of them, master after master in
    turn (so every pipeline holds keys from all over the call)."""
    masters = cluster.masters()
    owner = {slot: m.port for m in masters for slot in cluster.slots_of(m)}
    by_master: dict[int, list[bytes]] = {}
    for i in range(10_000):
        key = stem + b"%d" % i
        mine = by_master.setdefault(owner[key_slot(backend.names.name(key))], [])
        if len(mine) < per_master:
            mine.append(key)
        if len(by_master) == len(masters) and all(len(v) == per_master for v in by_master.values()):
            break
    keys = [k for group in zip(*by_master.values()) for k in group]
    return by_master, keys


@pytest.mark.parametrize("op", ["get", "exists", "set", "unlink"])
def test_regression_a_call_spanning_three_masters_sent_their_pipelines_one_after_another(
        redis_cluster, monkeypatch, op):
    backend = RedisBackend.from_url(redis_cluster.url, pipeline_bytes=BIG, node_threads=8)
    pool: list[threading.Thread] = []
    try:
        by_master, keys = spread(redis_cluster, backend, op.encode() + b"-")
        stored = set(keys[::2])  # hits and misses interleaved in every answer
        assert all(backend.put_many([(k, b"old " + k) for k in keys if k in stored]))
        spy = PipelineSpy(monkeypatch, meet=len(by_master))
        if op == "get":
            assert backend.get_many(keys) == [b"old " + k if k in stored else None for k in keys]
        elif op == "exists":
            assert backend.contains_many(keys) == [k in stored for k in keys]
        elif op == "set":
            assert backend.put_many([(k, b"new " + k) for k in keys]) == [True] * len(keys)
        else:
            assert backend.delete_many(keys) == len(stored)
        assert not spy.broken, "the call's node pipelines were sent one after another"
        assert sorted(spy.ports) == sorted(by_master)  # one pipeline per master, each once
        caller = threading.current_thread()
        assert len(set(spy.threads)) == len(by_master) and caller in spy.threads  # one with no thread hop
        pool = [t for t in spy.threads if t is not caller]
        assert all(t.name.startswith(THREAD_PREFIX) for t in pool)
        spy.barrier = None
        want = {"set": [b"new " + k for k in keys], "unlink": [None] * len(keys)}.get(op)
        if want is not None:  # what the call wrote landed where its keys live
            assert backend.get_many(keys) == want
    finally:
        backend.close()
    assert pool and not any(t.is_alive() for t in pool), "close() left the pipeline threads running"


def test_a_call_on_one_master_stays_on_the_callers_thread_and_makes_no_threads(redis_cluster, monkeypatch):
    backend = RedisBackend.from_url(redis_cluster.url, pipeline_bytes=BIG, node_threads=8)
    try:
        by_master, _ = spread(redis_cluster, backend, b"one-")
        keys = next(iter(by_master.values()))
        before = {t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)}
        spy = PipelineSpy(monkeypatch)
        assert all(backend.put_many([(k, b"v") for k in keys]))
        assert backend.get_many(keys) == [b"v"] * len(keys)
        assert spy.threads == [threading.current_thread()] * 2
        assert {t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)} == before
    finally:
        backend.close()


def _one_first(cluster: RedisClusterServers, backend: RedisBackend) -> tuple[Node, list[bytes], set[int]]:
    """A master (not the node the backend's URL names), keys of every master with that master's
    first (its pipeline is the call's first), and the other masters' ports."""
    by_master, keys = spread(cluster, backend, b"first-")
    one = next(m for m in cluster.masters() if m.port in by_master and m is not cluster.nodes[0])
    first = by_master[one.port]
    return one, first + [k for k in keys if k not in first], set(by_master) - {one.port}


def test_regression_a_hung_master_first_in_a_call_kept_the_other_masters_from_being_asked(
        own_redis_cluster, monkeypatch):
    # one after another, the hung master's timeout was raised before the others were asked;
    # at once, they answer while it hangs, and the call still costs one timeout, raised
    # only once every pipeline it started has ended (the barrier: each is sent only once all
    # three are in flight, so none is "not started yet" when the timeout comes)
    cluster = own_redis_cluster
    backend = RedisBackend.from_url(cluster.url, timeout="200ms", retries=2, pipeline_bytes=BIG,
                                    node_threads=8)
    hung, keys, others = _one_first(cluster, backend)
    put_all(backend, [(k, b"v") for k in keys])
    spy = PipelineSpy(monkeypatch, meet=len(others) + 1)
    hung.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(BackendUnavailable):
            backend.get_many(keys)
        assert not spy.broken, "the call's node pipelines were sent one after another"
        assert spy.in_flight == 0, "a node's pipeline was still running when the call returned"
        assert set(spy.answered) == others, "the healthy masters were not asked while one hung"
        assert spy.ports.count(hung.port) == 1  # the timeout was not sent again
    finally:
        hung.proc.send_signal(signal.SIGCONT)
        backend.close()


def test_after_a_failover_only_the_refused_masters_keys_are_sent_again(own_redis_cluster, monkeypatch):
    # a client that learned the topology before a master failed over: that master's connection
    # is refused, the others answer at once and are not asked again; the refused keys go to
    # the promoted replica after the topology is read again
    cluster = own_redis_cluster
    backend = RedisBackend.from_url(cluster.url, pipeline_bytes=BIG, node_threads=8)
    try:
        victim, keys, others = _one_first(cluster, backend)
        assert all(backend.put_many([(k, b"v" + k) for k in keys]))
        failed_over(cluster, victim)
        promoted = {m.port for m in cluster.masters()} - others
        spy = PipelineSpy(monkeypatch)
        assert backend.get_many(keys) == [b"v" + k for k in keys]
        assert sorted(spy.ports) == sorted([victim.port, *others, *promoted])  # each node once
        assert set(spy.answered) == others | promoted and backend.available
    finally:
        backend.close()


def test_every_nodes_error_is_weighed_and_the_deciding_one_raised():
    # the call raises an unexpected error before a timeout (never retried) before a refused
    # connection (retried); every job ran (the deciding error last: a job not started after a
    # timeout or an unexpected error is skipped, and whether one had started is a race)
    fanout = NodeFanout(8)
    ran: list[int] = []
    threads: set[threading.Thread] = set()

    def job(i: int, exc: Exception | None):
        def run():
            ran.append(i)
            threads.add(threading.current_thread())
            if exc is not None:
                raise exc
        return run

    cases = [([RedisConnectionError("a"), None, RedisTimeoutError("b")], RedisTimeoutError),
             ([None, RedisConnectionError("a"), ValueError("c")], ValueError),
             ([RedisConnectionError("a"), None, RedisConnectionError("d")], RedisConnectionError)]
    try:
        for errors, deciding in cases:
            ran.clear()
            with pytest.raises(deciding):
                fanout.run([job(i, e) for i, e in enumerate(errors)], lambda: 3)
            assert sorted(ran) == [0, 1, 2]
    finally:
        fanout.close()
    pool = threads - {threading.current_thread()}
    assert pool and all(t.name.startswith(THREAD_PREFIX) and not t.is_alive() for t in pool)
    threads.clear()
    fanout.run([job(0, None), job(1, None)], lambda: 3)  # after close: on the caller's thread
    assert ran[-2:] == [0, 1] and threads == {threading.current_thread()}


def test_by_default_a_calls_node_pipelines_go_one_after_another_on_the_callers_thread(
        redis_cluster, monkeypatch):
    backend = RedisBackend.from_url(redis_cluster.url, pipeline_bytes=BIG)
    try:
        by_master, keys = spread(redis_cluster, backend, b"default-")
        spy = PipelineSpy(monkeypatch)
        assert all(backend.put_many([(k, b"v") for k in keys]))
        assert backend.get_many(keys) == [b"v"] * len(keys)
        assert len(spy.ports) == 2 * len(by_master) and set(spy.threads) == {threading.current_thread()}
        assert not [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]
    finally:
        backend.close()


def test_node_threads_is_a_redis_option_and_never_negative():
    from tiered_kv.errors import ConfigError

    with pytest.raises(ConfigError):
        RedisBackend.from_url("redis+cluster://127.0.0.1:1?node_threads=-1")
    with pytest.raises(ConfigError):
        RedisBackend.from_url("redis+cluster://127.0.0.1:1?node_threads=many")


class FakeCluster:
    """Two nodes, A (slot 0: keys starting with a) and B, that fail as told; ``log`` names each
    pipeline sent and each topology read, in order."""

    def __init__(self, a_fails=(), b_fails=()) -> None:
        self.log: list[str] = []
        self.fails = {"A": list(a_fails), "B": list(b_fails)}
        self.nodes = {name: type("FakeNode", (), {"name": name})() for name in "AB"}
        cluster = self

        class Nodes:
            def get_node_from_slot(self, slot, load_balancing_strategy=None):
                return cluster.nodes["A" if slot == 0 else "B"]

            def initialize(self):
                cluster.log.append("topology")

        self.nodes_manager = Nodes()

    def keyslot(self, name: bytes) -> int:
        return 0 if name.startswith(b"a") else 1

    def get_redis_connection(self, node):
        cluster, node = self, node.name

        class Pipe:
            def __init__(self) -> None:
                self.names: list[bytes] = []

            def get(self, name):
                self.names.append(name)

            def execute(self, raise_on_error=False):
                cluster.log.append(node)
                if cluster.fails[node]:
                    raise cluster.fails[node].pop(0)
                return [b"v:" + n for n in self.names]

        class Connection:
            def pipeline(self, transaction=False):
                return Pipe()

        return Connection()

    def get_primaries(self):
        return list(self.nodes.values())


def _get(cluster: FakeCluster, retries: int) -> list:
    return node_pipelines(cluster, [b"a1", b"b1"], lambda name: name, lambda pipe, name: pipe.get(name),
                          read=True, retries=retries, backoff=lambda n: 0.0, fanout=NodeFanout())


def test_regression_by_default_a_refused_node_no_longer_stopped_the_pass_before_the_next_was_asked():
    # one node after another (node_threads = 0), the first error ends the pass at once, as it
    # always did: a refused node is retried with the nodes not asked yet, after the topology is
    # read again; with no retries left it is raised without asking (or waiting out) the others
    cluster = FakeCluster(a_fails=[RedisConnectionError("refused")])
    assert _get(cluster, retries=2) == [b"v:a1", b"v:b1"]
    assert cluster.log == ["A", "topology", "A", "B"]
    cluster = FakeCluster(a_fails=[RedisConnectionError("refused")], b_fails=[RedisTimeoutError("hung")])
    with pytest.raises(RedisConnectionError):
        _get(cluster, retries=0)
    assert cluster.log == ["A"]
