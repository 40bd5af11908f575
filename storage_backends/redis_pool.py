"""The connections of a Redis tier to one server: at most ``max_connections``; a call finding
every one busy waits for one, up to the call's timeout, then fails with :class:`ConnectionsBusy`.
That is this process's own limit, not the server away: the call is a counted miss and the
circuit breaker stays closed (redis-py's plain pool raised at once, and the breaker then failed
every call for a probe interval whenever more threads than connections called at once).

:class:`ConnectionsBusy` is no ``ConnectionError`` (redis-py's ``MaxConnectionsError`` is one):
what retries a connection error takes a node for gone (a cluster's node pipelines and admin
calls, redis-py's cluster pipeline, its cluster client before 6.4), reads the topology again and
tries again, so a call waited for a busy node's connections three times over, with two topology
reads between (redis-py before 6.4 also dropped the node's pool).

Its connections' sockets end their reads and writes by the current call's deadline, and a wait
for a connection ends by it too (:mod:`storage_backends.redis_deadline`).

With hiredis, redis-py gives each connection's parser a read buffer of ``socket_read_size``
(``READ_SIZE``, 1 MiB) for its lifetime, idle or closed: at ``max_connections`` of 10,000 that
was up to 10 GiB. Here the buffer is the reading thread's (:class:`ThreadBufferParser`):
a read fills it and hiredis copies what came at once, so the same 1 MiB reads, one per thread."""

from __future__ import annotations

import threading
from contextlib import suppress
from queue import Empty, LifoQueue
from typing import Any

import redis
from redis.connection import BlockingConnectionPool, Connection
from redis.exceptions import RedisError
from redis.utils import HIREDIS_AVAILABLE

try:  # (redis-py's own module: a version without it keeps its parsers, and their buffers)
    from redis._parsers.hiredis import _HiredisParser
except ImportError:  # pragma: no cover
    _HiredisParser = None

from storage_backends.heap_reuse import keep_large_allocations_in_heap
from storage_backends.redis_deadline import bounded_wait, guarded_class

READ_SIZE = 1 << 20  # bytes a connection's parser reads per recv (redis-py's 64 KiB: 16 calls for each MiB of a value)


class ConnectionsBusy(RedisError):
    """Every connection of a pool stayed busy for the wait (see the module docstring)."""


class _Slots(LifoQueue):
    """The pool's idle connections; an empty wait is :class:`ConnectionsBusy` (not Empty, which
    redis-py turns into a ConnectionError: the same error as a server that is away)."""

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        wait = bounded_wait(timeout)
        try:
            return super().get(block, wait)
        except Empty:  # (what was waited: the rest of the call's deadline when less than the pool's wait)
            cut = " (the rest of the call's deadline)" if wait is not None and wait != timeout else ""
            raise ConnectionsBusy(f"all {self.maxsize} connections busy for {wait or 0:.3g} s{cut} "
                                  "(the tier's max_connections)") from None


_thread = threading.local()  # .buffer: the reading thread's


class ThreadBufferParser(_HiredisParser or object):
    """redis-py's hiredis parser reading into the reading thread's buffer, not one of its own
    (see the module docstring): ``reader.feed`` copies a read before the thread reads again."""

    def __init__(self, socket_read_size: int) -> None:
        super().__init__(0)  # (redis-py's own buffer, of this size, is dropped by the setter)
        self.socket_read_size = socket_read_size

    @property  # type: ignore[override]
    def _buffer(self) -> bytearray:
        buffer = getattr(_thread, "buffer", None)
        if buffer is None or len(buffer) < self.socket_read_size:
            buffer = _thread.buffer = bytearray(self.socket_read_size)
        return buffer

    @_buffer.setter
    def _buffer(self, value: bytearray) -> None:
        """(redis-py's __init__ allocates one: it is dropped here)"""


class WaitingPool(BlockingConnectionPool):
    """A blocking pool whose wait is the connections' ``socket_timeout`` unless given, and
    whose connections keep the deadline of the call using them."""

    def __init__(self, max_connections: int = 64, timeout: float | None = None,
                 connection_class: type = Connection, **connection_kwargs: Any) -> None:
        if timeout is None:
            timeout = connection_kwargs.get("socket_timeout") or 2.0
        keep_large_allocations_in_heap()  # (each reply is a new block-sized bytes object)
        if HIREDIS_AVAILABLE and _HiredisParser is not None and "parser_class" not in connection_kwargs:
            connection_kwargs["parser_class"] = ThreadBufferParser
        super().__init__(max_connections=max_connections, timeout=timeout, queue_class=_Slots,
                         connection_class=guarded_class(connection_class), **connection_kwargs)


def single_client(target: str, **options: Any) -> redis.Redis:
    """A client of the server at ``target`` over a :class:`WaitingPool`; a connection's settings
    are checked now (raises ValueError / TypeError), no connection is made."""
    pool = WaitingPool.from_url(target, **options)
    pool.connection_class(**pool.connection_kwargs)
    client = redis.Redis(connection_pool=pool)
    client.auto_close_connection_pool = True
    return client


def close_client(client: Any) -> None:
    """Close every connection of ``client`` (a single server's pool, each cluster node's), if any."""
    if client is None:
        return
    with suppress(RedisError, OSError):
        client.close()  # (a single_client disconnects its pool)
    manager = getattr(client, "nodes_manager", None)
    if manager is not None:  # a cluster's close() only closes each node's client, whose pool
        # (made by from_url) it does not own: every node's connections stayed open
        for node in [*manager.startup_nodes.values(), *manager.nodes_cache.values()]:
            if node.redis_connection is not None:
                with suppress(RedisError, OSError):
                    node.redis_connection.connection_pool.disconnect()
