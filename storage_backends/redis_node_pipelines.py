"""Pipelines on a Redis Cluster, one per node, so that a hung node costs a call one timeout.

redis-py's cluster pipeline retries a timed-out pipeline at the cluster level whatever its retry
object says, then sends every command of it that failed again *one at a time*, each with its own
timeout: a GET pipeline of 64 keys on a master that stopped answering took 64 timeouts or more,
and the engine's forward pass waited for all of them. Here the commands of one call are grouped
by the node that serves each key's slot (a read may go to a replica when the client balances
reads), and each group is one plain pipeline on that node's own connection pool, whose
connections redis-py makes with no retries: a node that does not answer within the socket
timeout raises at once, once per call.

What a node answers per command is kept. MOVED and ASK (a slot moved or moving: resharding) are
followed here, in at most ``REDIRECT_ROUNDS`` more passes of per-node pipelines to the nodes they
name (behind ``ASKING`` after an ASK); a MOVED also updates the client's slot map, as redis-py's
own handling does. A command still redirected after that, or to a node the client does not
know yet, is answered its redirection (a miss). redis-py's cluster pipeline, which followed them
before, held a connection of every node of its commands at once, taken in its commands' order:
two calls taking two nodes' last connections in opposite orders waited out each other's
``timeout`` on a healthy cluster; and it sent each command still failing again one at a time,
each with its own timeout. Here a thread holds one connection at a time, never one while it
waits for another. A refused or dropped connection (a node restarted, a master that failed
over) re-reads the topology and sends that node's commands again, at most ``retries`` more
times in a call, with backoff; a timeout is never sent again. What still fails is raised, for
the caller's breaker.

With ``node_threads`` (0, the default: one node after another) a call spanning several nodes
sends their pipelines at once (:class:`NodeFanout`): one on the caller's thread, the others on
up to that many threads the backend owns, so its latency is that of its slowest node, not the
sum over nodes; a call on one node stays on the caller's thread. Each thread makes its own
pipeline object (never shared) on the node's connection pool (which is thread-safe), and a call
returns only once every pipeline it started has answered or failed; each runs in the caller's
context, so within the call's deadline (:mod:`storage_backends.redis_deadline`). Not the default: with client
and nodes on one 2-vCPU host it gained nothing for 2 MiB blocks and cost 25% of the GET rate of
128 KiB ones (threads parsing replies contend for the GIL); it is for round trips that dominate
(nodes across a network, a slow node).
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

from redis.exceptions import AskError, MovedError, RedisClusterException, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from storage_backends.redis_deadline import call_deadline
from storage_backends.redis_pool import ConnectionsBusy

log = logging.getLogger(__name__)

REDIRECTS = (MovedError, AskError)  # answered per command (a MovedError is an AskError too)
REDIRECT_ROUNDS = 3  # passes following redirections, after the first
_UNSENT = object()  # the reply of a command whose node has not answered yet
THREAD_PREFIX = "tiered-kv-redis-node"


class NodeFanout:
    """The threads on which a call spanning several nodes sends its per-node pipelines: made on
    first need, one per node the cluster has for a call (at most ``threads``; none: every
    pipeline on the caller's thread, one after another), joined by :meth:`close`."""

    def __init__(self, threads: int = 0) -> None:
        self.threads = threads
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def run(self, jobs: Sequence[Callable[[], None]], workers: Callable[[], int]) -> None:
        """Run ``jobs`` (one node's pipeline each). With no threads: one after another on the
        caller's thread, the first error raised at once. Else at once, the first on the caller's
        thread; returns when every job started has ended, then raises the error that decides the
        call (:func:`_deciding`). A job no thread has picked up when the caller gets to it is run by
        the caller: a call never waits for a thread that another call's hung node holds. After an
        error that is not retried, jobs not started are not started: the call raises anyway.
        ``workers()``: how many threads to make, the first time some are needed."""
        if len(jobs) <= 1 or not self.threads:  # one node, or none at once: in order, as ever
            for job in jobs:
                job()
            return
        futures = [self._submit(job, workers) for job in jobs[1:]]
        try:
            errors = [_error_of(jobs[0])]
            for job, future in zip(jobs[1:], futures):
                final = any(e is not None and not isinstance(e, RedisConnectionError) for e in errors)
                if future is None or future.cancel():  # not started (or the pool is shut down)
                    errors.append(None if final else _error_of(job))
                else:
                    errors.append(future.exception())  # waits: never abandoned while running
        finally:  # (the caller interrupted: what has not started never will)
            for future in futures:
                if future is not None:
                    future.cancel()
        deciding = _deciding(errors)
        if deciding is not None:
            raise deciding

    def _submit(self, job: Callable[[], None], workers: Callable[[], int]) -> Future | None:
        with self._lock:
            if self._closed:
                return None  # (a call racing close(): its caller runs the job)
            if self._pool is None:
                size = max(1, min(self.threads, workers()))
                self._pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix=THREAD_PREFIX)
                log.debug("redis cluster pipelines sent on %d threads", size)
            return self._pool.submit(contextvars.copy_context().run, job)  # (the call's deadline with it)

    def close(self) -> None:
        """Join the threads (a pipeline still running ends within the socket timeout); a call
        made after this runs its pipelines on the caller's thread."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _error_of(job: Callable[[], None]) -> BaseException | None:
    try:
        job()
    except Exception as exc:  # (kept: every node's error is weighed, none lost)
        return exc
    return None


def _deciding(errors: Sequence[BaseException | None]) -> BaseException | None:
    """The error a call raises when several nodes failed: one that is neither a timeout, a
    node's connections all busy, nor a refused connection (unexpected), else a timeout (never
    retried: a hung node costs one, and opens the breaker), else busy connections (this
    process's own limit: a counted miss, the breaker left closed; not retried, which would wait
    for them again), else a refused connection (retried); the others are logged."""
    failed = [e for e in errors if e is not None]
    if not failed:
        return None
    rank = {RedisTimeoutError: 1, ConnectionsBusy: 2, RedisConnectionError: 3}
    deciding = min(failed, key=lambda e: next((r for t, r in rank.items() if isinstance(e, t)), 0))
    for other in failed:
        if other is not deciding:
            log.debug("redis cluster node also failed in that call: %r", other)
    return deciding


def name_of(item: Any) -> bytes:
    """The key name of a pipelined item: a name, or a (name, value) pair."""
    return item if isinstance(item, bytes) else item[0]


def node_pipelines(client: Any, items: Sequence, name_of: Callable[[Any], bytes],
                   add: Callable[[Any, Any], Any], *, read: bool, retries: int,
                   backoff: Callable[[int], float], fanout: NodeFanout) -> list:
    """The replies to ``add(pipe, item)`` for every item, in order (per-command errors as
    values, as ``execute(raise_on_error=False)`` gives them); the key of an item is
    ``name_of(item)``. ``read``: commands a replica may answer, when ``client`` balances reads.
    The nodes' pipelines go at once on ``fanout``; redirections are followed (module docstring)."""
    replies: list = [_UNSENT] * len(items)
    balance = getattr(client, "load_balancing_strategy", None) if read else None
    manager = client.nodes_manager

    def owner(i: int) -> tuple[Any, bool]:  # (on the caller's thread: a balanced read's round robin is not shared)
        return manager.get_node_from_slot(client.keyslot(name_of(items[i])), load_balancing_strategy=balance), False

    send = partial(_deliver, client, items, add, replies, fanout, retries, backoff)
    failures = send(list(range(len(items))), owner, 0)
    for _ in range(REDIRECT_ROUNDS):
        again = {i: r for i, r in enumerate(replies) if isinstance(r, REDIRECTS)}
        if not again:
            break
        for moved in {r.slot_id: r for r in again.values() if isinstance(r, MovedError)}.values():
            _learn(manager, moved)
        nodes = {i: (client.get_node(host=r.host, port=r.port), not isinstance(r, MovedError)) for i, r in again.items()}
        pending = [i for i, (node, _) in nodes.items() if node is not None]  # (a node not known yet: a miss)
        for i in pending:
            replies[i] = _UNSENT
        failures = send(pending, nodes.__getitem__, failures)
    return replies


def _learn(manager: Any, moved: MovedError) -> None:
    """The client's slot map takes a MOVED's new owner, as redis-py's own MOVED handling does
    (no round trip: the next calls go there at once); best effort."""
    try:
        if hasattr(manager, "move_slot"):  # redis-py >= 7.2
            manager.move_slot(moved)
        else:  # applied as the slot is next looked up
            manager.update_moved_exception(moved)
    except (KeyError, RedisError) as exc:  # (a slot the map does not hold)
        log.debug("redis cluster slot map not updated from %r: %r", moved, exc)


def _deliver(client: Any, items: Sequence, add, replies: list, fanout: NodeFanout, retries: int,
             backoff: Callable[[int], float], pending: list[int], route: Callable[[int], tuple[Any, bool]],
             failures: int) -> int:
    """Send the ``pending`` items, each to ``route(i)`` ((node, behind ASKING)): a refused
    connection reads the topology again and sends what did not answer again, while the call's
    ``failures`` are at most ``retries``; a timeout raises at once. Returns the failures."""
    while pending:
        try:
            _send(client, items, add, pending, replies, route, fanout)
            return failures
        except RedisTimeoutError:
            raise  # hung or black-holed: asking again only doubles the wait
        except RedisConnectionError as exc:
            if failures >= retries:
                raise
            failures += 1
            log.debug("redis cluster node unreachable (%r); topology read again, try %d", exc, failures)
            time.sleep(backoff(failures))
            reinitialize(client)
            pending = [i for i in pending if replies[i] is _UNSENT]  # (a node that answered is not asked again)
    return failures


def _send(client: Any, items: Sequence, add, pending: list[int], replies: list,
          route: Callable[[int], tuple[Any, bool]], fanout: NodeFanout) -> None:
    """One pipeline per node for the ``pending`` items (sent as ``fanout`` runs them); their
    replies stored as each node answers (a node that fails leaves its items ``_UNSENT``)."""
    groups: dict[tuple[str, bool], tuple[Any, list[int]]] = {}
    for i in pending:
        node, asking = route(i)
        groups.setdefault((node.name, asking), (node, []))[1].append(i)
    fanout.run([partial(_node_pipeline, client, node, members, items, add, replies, asking)
                for (_, asking), (node, members) in groups.items()], partial(_nodes_of, client))


def _nodes_of(client: Any) -> int:
    """The nodes a call may span: the masters, and their replicas when reads are balanced."""
    return len(client.get_nodes() if getattr(client, "load_balancing_strategy", None) else client.get_primaries())


def _node_pipeline(client: Any, node: Any, members: list[int], items: Sequence, add, replies: list,
                   asking: bool = False) -> None:
    """One node's pipeline, made on the thread that sends it (a pipeline is never shared); with
    ``asking``, each command behind an ``ASKING`` (which lets the node serve a slot it imports)."""
    pipe = client.get_redis_connection(node).pipeline(transaction=False)
    for i in members:
        if asking:
            pipe.execute_command("ASKING")
        add(pipe, items[i])
    answers = pipe.execute(raise_on_error=False)
    for i, reply in zip(members, answers[1::2] if asking else answers):
        replies[i] = reply  # (each thread its own indices)


def reinitialize(client: Any) -> None:
    """Read the cluster's slots again (a promoted replica, a node back); failing that, the next
    try uses what is known."""
    try:
        client.nodes_manager.initialize()
    except (RedisError, RedisClusterException, OSError) as exc:
        log.debug("redis cluster topology not read: %r", exc)


def ping_every_node(client: Any, nodes: str, timeout: float | None = None) -> None:
    """PING ``nodes`` (``RedisCluster.PRIMARIES`` or ``ALL_NODES``) after reading the topology
    again; raises when one does not answer. With ``timeout``, the read has ``timeout`` per startup
    node and one more (redis-py before 8 asks them in a fixed order: under one ``timeout`` a hung
    first node spent it all, the others were never asked, and a cluster healed by a failover kept
    its breaker open while that node hung), the PINGs one ``timeout`` together."""
    budget = None if timeout is None else timeout * (len(getattr(client.nodes_manager, "startup_nodes", ())) + 1)
    with call_deadline(budget):
        reinitialize(client)
    with call_deadline(timeout):
        client.ping(target_nodes=nodes)
