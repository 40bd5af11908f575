"""redis-py's errors as the Redis tier's own: what a failed call raises, and whether it opens the
tier's circuit breaker (:mod:`storage_backends.redis_breaker`).

- A server that answers but refuses (``READONLY``, ``MISCONF``, ``NOPERM``, ``OOM``): a
  :class:`BackendError`; reads still work, so the breaker stays closed.
- All of the tier's connections busy (ours, not the server's): :class:`BackendUnavailable`, the
  breaker closed.
- The user or password of the URL refused as a connection authenticates (``AUTH`` / ``HELLO``:
  ``WRONGPASS``, ``NOAUTH``; redis-py's AuthenticationError, which a cluster's first topology
  read raises wrapped in a RedisClusterException): :class:`CredentialsRefused`, a
  BackendUnavailable (an engine counts the tier down) that tools report as configuration; the
  breaker opens, as for any server not to be talked to. A URL that gives no user or password is
  told to give one (it was told that the one in it was wrong).
- Anything else (refused, dropped or timed-out connections, a cluster down, a server speaking
  no Redis protocol): :class:`BackendUnavailable`, the breaker open.

Messages name the server by its redacted URL."""

from __future__ import annotations

from redis.exceptions import (
    AuthenticationError,
    ClusterDownError,
    MaxConnectionsError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from storage_backends.redaction import MASK
from storage_backends.redis_pool import ConnectionsBusy
from tiered_kv.errors import BackendError, BackendUnavailable, CredentialsRefused

# (BusyLoadingError, i.e. LOADING, and AuthenticationError are ConnectionErrors)
DOWN_ERRORS = (RedisConnectionError, RedisTimeoutError, ClusterDownError, TryAgainError, RedisClusterException, OSError)


def our_error(exc: BaseException, url: str) -> tuple[BackendError, bool]:
    """(the error a call failing with redis-py's ``exc`` raises, whether the breaker opens);
    ``url`` is the redacted URL."""
    at = f"redis at {url}"
    if isinstance(exc, ResponseError) and not isinstance(exc, DOWN_ERRORS):  # READONLY, MISCONF, NOPERM
        return BackendError(f"{at} refused the call: {exc}"), False
    if isinstance(exc, (ConnectionsBusy, MaxConnectionsError)):
        return BackendUnavailable(f"{at}: {exc}"), False
    refusal = refused_credentials(exc)
    if refusal is not None:
        return CredentialsRefused(f"authentication failed for the tier at {url} ({_fix(url)}): {refusal}"), True
    return BackendUnavailable(f"{at} unavailable: {exc}"), True


def _fix(url: str) -> str:
    """What to look at in ``url`` (redacted) when its credentials were refused: a URL with none
    was told that a user or password in it was wrong (and the server's answer to one without
    spoke of HELLO AUTH)."""
    if "@" in url or MASK in url:  # (a user or password, or a password=... query value)
        return "a wrong user or password in its URL"
    return "the server asks for a password and its URL gives none: [USER]:PASSWORD@ before its host"


def refused_credentials(exc: BaseException | None) -> AuthenticationError | None:
    """The AuthenticationError ``exc`` is, or was raised from (a cluster client wraps what its
    startup nodes answered), or None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, AuthenticationError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__
    return None
