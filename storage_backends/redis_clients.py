"""The redis-py client of a Redis tier, made with the tier's timeouts, retries and connection
pool (:mod:`storage_backends.redis_pool`): a single server's at once (it makes no connection yet;
a connection's settings are checked as one is made), a cluster's as a factory called on first use
(it connects, reading the topology).

A single server's refused or dropped connections are retried with the tier's backoff (at most
``retries`` more tries); a timeout is not (a server that did not answer in ``timeout`` seconds
is hung or black-holed: asking again only doubles the wait), nor a refused user or password
(redis-py's AuthenticationError is a ConnectionError: a wrong password was sent ``retries`` more
times a call, with backoff, and some managed Redis lock a client out after a few). A cluster client retries nothing
itself (redis-py's retries a timeout whatever its retry object says): GETs, TYPEs, SETs and
UNLINKs go one pipeline per node, retried per node (:mod:`storage_backends.redis_node_pipelines`),
SCAN and INFO as whole calls (:mod:`storage_backends.redis_admin`). Commands go through our
packer (:mod:`storage_backends.redis_packer`) everywhere but on the TLS cluster client, which
brings its own connections."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import AbstractBackoff, NoBackoff
from redis.cluster import LoadBalancingStrategy
from redis.connection import parse_url
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry

from storage_backends.redaction import redact_text, redact_url
from storage_backends.redis_options import check_cluster_options
from storage_backends.redis_packer import PACKER, PackedConnection
from storage_backends.redis_pool import READ_SIZE, WaitingPool, single_client
from tiered_kv.errors import ConfigError


class _Refused(Exception):
    """Carries a refused user or password past the retry loop (no error it retries)."""

    def __init__(self, error: AuthenticationError) -> None:
        super().__init__(str(error))
        self.error = error


class CredentialsNotRetried(Retry):
    """redis-py's retry of refused and dropped connections, less a refused user or password."""

    def call_with_retry(self, do, fail, *args, **kwargs):
        def once():
            try:
                return do()
            except AuthenticationError as exc:
                raise _Refused(exc) from None

        try:
            return super().call_with_retry(once, fail, *args, **kwargs)
        except _Refused as refused:
            raise refused.error from None


def takes_gathered(target: str, cluster: bool) -> bool:
    """Whether raw blocks may come as head + host slot (no copy next to the head): where our
    packer sends the commands, everywhere but the TLS cluster client."""
    return not (cluster and target.startswith("rediss://"))


def make_client(url: str, target: str, *, cluster: bool, timeout: float, retries: int, max_connections: int,
                backoff: AbstractBackoff, read_from_replicas: bool = False) -> tuple[Any, Callable[[], Any] | None]:
    """(the single server's client, None), or (None, the factory of the cluster's) for
    ``target`` (redis-py's URL; ``url``: the tier's, named redacted in errors). A URL or option
    redis-py refuses is a ConfigError."""
    retry = CredentialsNotRetried(backoff, retries, supported_errors=(RedisConnectionError, ConnectionError))
    common: dict[str, Any] = dict(socket_timeout=timeout, socket_connect_timeout=timeout, socket_read_size=READ_SIZE,
                                  retry=retry, max_connections=max_connections)
    try:
        if not cluster:
            return single_client(target, command_packer=PACKER, **common), None
        if parse_url(target).get("path"):
            raise ConfigError("Redis Cluster cannot be reached over a unix socket")
        if not target.startswith("rediss://"):  # the TLS cluster client sets its own class
            common["connection_class"] = PackedConnection
        if read_from_replicas:  # GETs and TYPEs round robin over each slot's master and replicas: a block
            # is immutable under its key and checked when read: a replica is only behind (a miss), never wrong
            common["load_balancing_strategy"] = LoadBalancingStrategy.ROUND_ROBIN
        common["retry"] = Retry(NoBackoff(), 0)  # (see the module docstring)
        check_cluster_options(target, common)
    except (ValueError, TypeError, redis.RedisError) as exc:
        raise ConfigError(f"bad Redis URL {redact_url(url)!r}: {redact_text(str(exc), url)}") from None
    return None, lambda: redis.RedisCluster.from_url(  # connects; each node's pool waits too
        target, connection_pool_class=WaitingPool, **common)
