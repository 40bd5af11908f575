"""How one Redis tier's calls reach its server: the redis-py client (a single server's made with
the tier, connecting per call; a cluster's made, and connected, on first use), every call run
behind the tier's circuit breaker (:mod:`storage_backends.redis_breaker`) and within a deadline
(:mod:`storage_backends.redis_deadline`), redis-py's errors turned into ours
(:mod:`storage_backends.redis_errors`), and the breaker's probe (a PING; in a cluster every master,
after reading the topology again). Closed, it refuses calls (:class:`BackendClosed`) and closes
every connection, those a call or probe running meanwhile puts back too."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

from storage_backends.redis_admin import AdminRetry
from storage_backends.redis_breaker import Breaker
from storage_backends.redis_deadline import call_deadline
from storage_backends.redis_errors import DOWN_ERRORS, our_error
from storage_backends.redis_node_pipelines import ping_every_node
from storage_backends.redis_pool import close_client
from tiered_kv.errors import BackendClosed, BackendUnavailable

T = TypeVar("T")


class RedisCalls:
    """The way to the server of the tier at ``url`` (redacted): ``client`` (a single server's)
    or ``make_cluster`` (a cluster client's factory); ``admin`` retries a cluster's SCAN and
    INFO; ``count(errors=1)`` counts each failed call."""

    def __init__(self, url: str, *, timeout: float, client: Any = None, make_cluster: Callable[[], Any] | None = None,
                 balanced: bool = False, admin: AdminRetry, count: Callable[..., None]) -> None:
        self.url, self.timeout, self.cluster = url, timeout, make_cluster is not None
        self._client, self._make_cluster, self._balanced = client, make_cluster, balanced
        self._client_lock, self._tries = threading.Lock(), 0
        self._admin, self._count = admin, count
        self.closed = False
        self.breaker = Breaker(url, self.ping, DOWN_ERRORS + (redis.RedisError,), timeout)

    @property
    def client(self) -> Any:
        """The redis-py client (a cluster client is made, and connects, on first use). A call that
        waited while another's try failed fails too: each made one more try, a connect timeout each."""
        if self._client is None:
            tries = self._tries
            with self._client_lock:
                if self._client is None:
                    if self._tries != tries:
                        raise RedisClusterException("Redis Cluster not reached by the try this call waited on")
                    try:
                        self._client = self._make_cluster()  # type: ignore[misc]
                    finally:  # (a try ended: who waited on it and finds no client fails)
                        self._tries += 1
        return self._client

    @property
    def made(self) -> Any:
        """The client if it was made yet (a cluster's is made on first use), else None."""
        return self._client

    @property
    def available(self) -> bool:
        """False while the breaker is open (calls fail at once until a probe gets an answer) or closed."""
        return not self.breaker.open and not self.closed

    def call(self, fn: Callable[[Any], T], *, admin: bool = False) -> T:
        """``fn(client)`` behind the breaker (``admin``: SCAN, INFO); Redis away raises
        BackendUnavailable (CredentialsRefused for a refused user or password)."""
        if self.closed:
            raise BackendClosed(f"redis backend at {self.url} is closed")
        if self.breaker.open:  # the background probe decides when to close
            self._count(errors=1)
            raise BackendUnavailable(f"redis at {self.url} is down "
                                     f"(next probe in {self.breaker.next_probe_s():.1f}s)")
        try:  # within a deadline of ``timeout`` + a per-byte allowance (storage_backends.redis_deadline)
            with call_deadline(self.timeout, paged=admin):  # (admin: per round trip, a SCAN is many)
                return self._admin.call(self.client, fn) if admin and self.cluster else fn(self.client)
        except (*DOWN_ERRORS, redis.RedisError) as exc:  # (a protocol error too: nothing to talk to)
            self._count(errors=1)
            error, down = our_error(exc, self.url)
            if down:
                self.breaker.trip(exc)
            raise error from None
        finally:
            self.drop_if_closed()

    def ping(self) -> None:
        """What the breaker's probe asks: a PING; in a cluster every master (and replica, when
        they answer reads) after reading the topology again, not only the client's default node."""
        try:
            if self.cluster:
                ping_every_node(self.client, RedisCluster.ALL_NODES if self._balanced else RedisCluster.PRIMARIES,
                                self.timeout)
            else:
                self.client.ping()
        finally:
            self.drop_if_closed()

    def drop_if_closed(self) -> None:
        """After a call, probe or look: once closed (close() ran meanwhile), the connection it put back goes too."""
        if self.closed:
            close_client(self._client)

    def close(self) -> None:
        """Refuse calls and stop the probe (the connections: :meth:`disconnect`)."""
        self.closed = True
        self.breaker.close()

    def disconnect(self) -> None:
        close_client(self._client)
