"""Pipelines on a Redis Cluster, one per node, so that a hung node costs a call one timeout.

redis-py's cluster pipeline retries a timed-out pipeline at the cluster level whatever its retry
object says, then sends every command of it that failed again *one at a time*, each with its own
timeout: a GET pipeline of 64 keys on a master that stopped answering took 64 timeouts or more,
and the engine's forward pass waited for all of them. Here the commands of one call are grouped
by the node that serves each key's slot (a read may go to a replica when the client balances
reads), and each group is one plain pipeline on that node's own connection pool, whose
connections redis-py makes with no retries: a node that does not answer within the socket
timeout raises at once, once per call.

What a node answers per command is kept: MOVED and ASK (a slot moved or moving: resharding) are
sent again through redis-py's cluster pipeline, which follows them and learns the new owner; a
refused or dropped connection (a node restarted, a master that failed over) re-reads the
topology and sends that node's commands again, at most ``retries`` more times with backoff;
a timeout is never sent again. What still fails is raised, for the caller's breaker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import AskError, MovedError, RedisClusterException, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)

REDIRECTS = (MovedError, AskError)  # answered per command: redis-py's cluster pipeline follows them
_UNSENT = object()  # the reply of a command whose node has not answered yet


def node_pipelines(client: Any, items: Sequence, name_of: Callable[[Any], bytes],
                   add: Callable[[Any, Any], Any], *, read: bool, retries: int,
                   backoff: Callable[[int], float]) -> list:
    """The replies to ``add(pipe, item)`` for every item, in order (per-command errors as
    values, as ``execute(raise_on_error=False)`` gives them); the key of an item is
    ``name_of(item)``. ``read``: commands a replica may answer, when ``client`` balances reads."""
    replies: list = [_UNSENT] * len(items)
    pending = list(range(len(items)))
    failures = 0
    while pending:
        try:
            _send(client, items, name_of, add, read, pending, replies)
            pending = []
        except RedisTimeoutError:
            raise  # hung or black-holed: asking again only doubles the wait
        except RedisConnectionError as exc:
            if failures >= retries:
                raise
            failures += 1
            log.debug("redis cluster node unreachable (%r); topology read again, try %d", exc, failures)
            time.sleep(backoff(failures))
            _reinitialize(client)
            pending = [i for i in pending if replies[i] is _UNSENT]  # (a node that answered is not asked again)
    again = [i for i, reply in enumerate(replies) if isinstance(reply, REDIRECTS)]
    if again:
        pipe = client.pipeline(transaction=False)
        for i in again:
            add(pipe, items[i])
        for i, reply in zip(again, pipe.execute(raise_on_error=False)):
            replies[i] = reply
    return replies


def _send(client: Any, items: Sequence, name_of, add, read: bool, pending: list[int], replies: list) -> None:
    """One pipeline per node for the ``pending`` items; their replies stored as they come."""
    balance = getattr(client, "load_balancing_strategy", None) if read else None
    groups: dict[str, tuple[Any, list[int]]] = {}
    manager = client.nodes_manager
    for i in pending:
        node = manager.get_node_from_slot(client.keyslot(name_of(items[i])), load_balancing_strategy=balance)
        groups.setdefault(node.name, (node, []))[1].append(i)
    for node, members in groups.values():
        pipe = client.get_redis_connection(node).pipeline(transaction=False)
        for i in members:
            add(pipe, items[i])
        for i, reply in zip(members, pipe.execute(raise_on_error=False)):
            replies[i] = reply


def _reinitialize(client: Any) -> None:
    """Read the cluster's slots again (a promoted replica, a node back); failing that, the next
    try uses what is known."""
    try:
        client.nodes_manager.initialize()
    except (RedisError, RedisClusterException, OSError) as exc:
        log.debug("redis cluster topology not read: %r", exc)


def ping_every_node(client: Any, nodes: str) -> None:
    """PING ``nodes`` (``RedisCluster.PRIMARIES`` or ``ALL_NODES``) after reading the topology
    again; raises when one does not answer."""
    _reinitialize(client)
    client.ping(target_nodes=nodes)
