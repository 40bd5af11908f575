"""Admin calls on a Redis Cluster (SCAN for listing keys and counting them, INFO for figures):
retried a few times with a short backoff, the topology read again before each new try.

The cluster client itself retries nothing (``Retry(NoBackoff(), 0)``: it would retry a timeout
whatever its retry object says, and a hung node must cost the data path one timeout); GETs,
TYPEs, SETs and UNLINKs retry per node (:mod:`storage_backends.redis_node_pipelines`). Without
this, a SCAN or INFO that met a master gone since the topology was read (failed over, restarted)
failed on its first refused connection. A try runs the whole call again (SCAN's cursors are per
node and die with it; what a call collects is collected afresh), and a timeout is not retried
(a hung node would cost one per try)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from redis.backoff import AbstractBackoff
from redis.exceptions import AuthenticationError, ClusterDownError, SlotNotCoveredError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError

from storage_backends.redis_node_pipelines import reinitialize

log = logging.getLogger(__name__)

T = TypeVar("T")
# a node refused or dropped the connection, or the cluster is between owners of a slot
RETRIED = (RedisConnectionError, ClusterDownError, TryAgainError, SlotNotCoveredError)


class AdminRetry:
    """``call(client, fn)``: ``fn(client)``, tried again at most ``retries`` times on the
    errors above (a wrong password is not: it does not mend), with ``backoff`` between tries.
    (A loop of our own: redis-py's ``Retry.call_with_retry`` took the arguments this needs only
    from 7.x, and the project supports redis-py 5 and 6.)"""

    def __init__(self, backoff: AbstractBackoff, retries: int) -> None:
        self._backoff, self._retries = backoff, retries

    def call(self, client: Any, fn: Callable[[Any], T]) -> T:
        self._backoff.reset()
        tries = 0
        while True:
            try:
                return fn(client)
            except RETRIED as exc:
                if isinstance(exc, AuthenticationError) or tries >= self._retries:
                    raise
                tries += 1
                log.debug("redis cluster admin call failed (%r), try %d", exc, tries)
                time.sleep(self._backoff.compute(tries))
                reinitialize(client)  # after the backoff: a promoted replica is seen by then, if ever
