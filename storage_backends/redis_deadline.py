"""Whole-call deadlines for the Redis tier.

redis-py's ``socket_timeout`` bounds each socket read, not a call: a Redis (or a network path, a
proxy) that trickles a reply just faster than ``timeout`` kept a call going for minutes (a 2 MiB
GET at 20 KB/s: 100 s), and a synchronous load held the engine's forward pass, a lookup its
scheduler, that long. Here every call of the tier (:meth:`RedisBackend._call`: one pipeline of
GETs, TYPEs or SETs, one UNLINK, with the tries and nodes it spans) runs under a
:class:`Deadline`: it may take ``timeout`` seconds plus one second per ``MIN_RATE`` bytes it
has moved (sent or received) so far. A call that keeps moving at least ``MIN_RATE`` bytes a
second goes on; one slower than that, on average, fails within ``timeout + bytes / MIN_RATE``:
at most ``timeout`` + 1 s per 4 MiB pipeline at the defaults. A call that moves its bytes within
``timeout`` (every healthy one) never meets its deadline.

How: each connection's socket is a :class:`GuardedSocket`, whose reads and writes wait at most
what is left of the current call's deadline (a wait for a pooled connection too; a connect is
bounded by its own timeout and does not count); past it a read or write raises ``socket.timeout``, which redis-py turns into its
``TimeoutError`` after dropping the connection (a half-read reply is never read by the next
call; a timeout is not retried), and the tier into ``BackendUnavailable``, opening the breaker.
No thread, and no system call on the way when the deadline is further than the socket's own
timeout (it then bounds the wait anyway). The deadline is a context variable: a cluster call's
node pipelines sent on other threads (:class:`~storage_backends.redis_node_pipelines.NodeFanout`)
run in the caller's context. Admin calls (SCAN, INFO) get a deadline per round trip
(``paged``): a SCAN of a large database is many short round trips, each bounded, not one.
"""

from __future__ import annotations

import socket
import time
from contextvars import ContextVar
from typing import Any

MIN_RATE = 4 << 20  # bytes per second a call must average once it has run ``timeout`` seconds
SEND_PIECE = 1 << 20  # a large write goes in pieces, each bounded (a TLS sendall bounds each send)


class Deadline:
    """When the current call must end: ``timeout`` seconds from its start (from its round
    trip's start, ``paged``) plus one second per ``MIN_RATE`` bytes moved."""

    __slots__ = ("timeout", "paged", "start", "moved", "replied")

    def __init__(self, timeout: float, paged: bool = False) -> None:
        self.timeout, self.paged = timeout, paged
        self.start, self.moved, self.replied = time.monotonic(), 0, False

    def left(self) -> float:
        """Seconds left (<= 0: passed)."""
        return self.start + self.timeout + self.moved / MIN_RATE - time.monotonic()

    def bound(self, wait: float | None) -> float | None:
        """``wait`` (a socket's timeout; None: none), at most what is left; raises
        ``socket.timeout`` (TimeoutError) once the deadline has passed."""
        left = self.left()
        if left <= 0:
            raise TimeoutError("the Redis call ran past its deadline")  # (socket.timeout)
        return left if wait is None or wait > left else wait

    def sending(self, nbytes: int) -> None:
        if self.paged and self.replied:  # a new round trip
            self.start, self.moved, self.replied = time.monotonic(), 0, False
        self.moved += nbytes

    def received(self, nbytes: int) -> None:
        self.moved += nbytes
        self.replied = True


_current: ContextVar[Deadline | None] = ContextVar("tiered_kv_redis_deadline", default=None)


class call_deadline:  # (lower case: used as a function, ``with call_deadline(timeout):``)
    """Run the block as one call under a :class:`Deadline` of ``timeout`` (see the module
    docstring); ``timeout`` None: the block keeps whatever deadline it runs under."""

    __slots__ = ("deadline", "_token")

    def __init__(self, timeout: float | None, *, paged: bool = False) -> None:
        self.deadline = None if timeout is None else Deadline(timeout, paged)

    def __enter__(self) -> Deadline | None:
        if self.deadline is not None:
            self._token = _current.set(self.deadline)
        return self.deadline

    def __exit__(self, *exc: object) -> None:
        if self.deadline is not None:
            _current.reset(self._token)


def bounded_wait(wait: float | None) -> float | None:
    """``wait`` at most what is left of the current call's deadline (a pool's wait for a
    connection; 0 once it has passed), or ``wait`` outside a call."""
    deadline = _current.get()
    if deadline is None:
        return wait
    left = max(deadline.left(), 0.0)
    return left if wait is None or wait > left else wait


class GuardedSocket:
    """A connection's socket (plain or TLS) whose reads and writes end by the deadline of the
    call using it; everything else is the socket's own."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._timeout = sock.gettimeout()  # as redis-py sets it (the socket timeout)
        self._applied = self._timeout  # what the socket has now

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def settimeout(self, value: float | None) -> None:
        self._sock.settimeout(value)
        self._timeout = self._applied = value

    def gettimeout(self) -> float | None:
        return self._timeout

    def _guard(self) -> Deadline | None:
        """Give the socket the wait the current call may spend (its own timeout outside a call)."""
        deadline = _current.get()
        want = self._timeout if deadline is None or self._timeout == 0 else deadline.bound(self._timeout)
        if want != self._applied:
            self._sock.settimeout(want)
            self._applied = want
        return deadline

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        deadline = self._guard()
        n = self._sock.recv_into(buffer, nbytes, flags)
        if deadline is not None:
            deadline.received(n)
        return n

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        deadline = self._guard()
        data = self._sock.recv(bufsize, flags)
        if deadline is not None and not flags & socket.MSG_PEEK:
            deadline.received(len(data))
        return data

    def sendall(self, data: Any, flags: int = 0) -> None:
        view = memoryview(data).cast("B")
        deadline = _current.get()
        if deadline is not None:
            deadline.sending(view.nbytes)
        for start in range(0, max(view.nbytes, 1), SEND_PIECE):
            self._guard()
            self._sock.sendall(view[start : start + SEND_PIECE], flags)


def guarded_class(connection_class: type) -> type:
    """``connection_class`` whose sockets are :class:`GuardedSocket` and whose connects do not
    count against the call's deadline (made once per class)."""
    if issubclass(connection_class, _Guarded):
        return connection_class
    made = _classes.get(connection_class)
    if made is None:
        made = _classes[connection_class] = type(f"Guarded{connection_class.__name__}",
                                                 (_Guarded, connection_class), {})
    return made


class _Guarded:
    """The base :func:`guarded_class` puts before a redis-py connection class: the time its
    ``_connect`` takes (bounded by the connect timeout, each attempt) is not the call's (a
    cluster's first call connects to a startup node, then to the node of its keys: under one
    budget, a loaded host failed those at a 300 ms timeout), and its socket is guarded."""

    def _connect(self) -> Any:
        deadline, began = _current.get(), time.monotonic()
        try:
            sock = super()._connect()  # type: ignore[misc]
        finally:
            if deadline is not None:
                deadline.start += time.monotonic() - began
        return GuardedSocket(sock)


_classes: dict[type, type] = {}
