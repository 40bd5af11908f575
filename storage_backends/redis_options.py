"""Options of the Redis tier from its URL and keywords."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit

from redis.cluster import cleanup_kwargs
from redis.connection import ConnectionPool, parse_url
from redis.exceptions import RedisError

from storage_backends.options import split_options
from storage_backends.redaction import password_misread, redact_text, redact_url
from tiered_kv.errors import ConfigError
from tiered_kv.units import as_bool, as_int, parse_duration, parse_size

MAX_TIMEOUT_S = 86400.0  # a call not answered in a day is hung (past ~292 years every socket call raises)
MAX_TTL_S = 100 * 365 * 86400.0  # Redis refuses every SET whose expiry passes 2**63 ms
# counts with a ceiling: each was unbounded, and a huge one stalled or exhausted the process
MAX_RETRIES = 10  # refused connections a call tries again, backoff (<= 0.5 s) between: ~3 s at most
MAX_CONNECTIONS = 10_000  # Redis' default maxclients (a pool is filled with that many slots as it opens)
MAX_NODE_THREADS = 64  # threads sending a cluster call's per-node pipelines at once


def count(value: Any, name: str, minimum: int, maximum: int) -> int:
    """A whole number in ``minimum..maximum``, else ConfigError naming ``name``."""
    number = as_int(value, name, minimum=minimum)
    if number > maximum:
        raise ConfigError(f"{name} must be at most {maximum}, got {number}")
    return number


def check_counts(retries: Any, max_connections: Any, node_threads: Any) -> None:
    """The bounds above for a backend made without :func:`redis_arguments` (keywords)."""
    count(retries, "redis retries", 0, MAX_RETRIES)
    count(max_connections, "redis max_connections", 1, MAX_CONNECTIONS)
    count(node_threads, "redis node_threads", 0, MAX_NODE_THREADS)


def ttl_seconds(seconds: float | None, name: str) -> float | None:
    """A Redis ttl in seconds (None or 0: no expiry); ConfigError past MAX_TTL_S."""
    if seconds is not None and seconds > MAX_TTL_S:
        raise ConfigError(f"{name} must be at most 100 years, got {seconds:g} s")
    return seconds


def _timeout(seconds: float, name: str) -> float:
    if not 0 < seconds <= MAX_TIMEOUT_S:
        raise ConfigError(f"{name} must be positive and at most 1d, got {seconds}")
    return seconds


def _no_quota(value: Any, name: str) -> None:
    raise ConfigError(f"{name}: Redis keeps no per-tenant quotas; it evicts by its own "
                      f"maxmemory-policy (set maxmemory on the server, or a ttl here)")


def _prefix(value: Any, name: str) -> str | bytes:
    # (a TOML ``prefix = 5`` became bytes(5), five NUL bytes: a namespace no tool was told of)
    if not isinstance(value, (str, bytes)):
        raise ConfigError(f"{name} must be a string, got {value!r}")
    return value


PARSERS: dict[str, Callable[[Any, str], Any]] = {
    "prefix": _prefix, "retries": lambda v, name: count(v, name, 0, MAX_RETRIES),
    "max_connections": lambda v, name: count(v, name, 1, MAX_CONNECTIONS), "cluster": as_bool,
    "read_from_replicas": as_bool, "node_threads": lambda v, name: count(v, name, 0, MAX_NODE_THREADS),
    "ttl": lambda v, name: None if str(v).lower() in ("none", "", "0") else ttl_seconds(parse_duration(v, name=name), name),
    "timeout": lambda v, name: _timeout(parse_duration(v, name=name), name),
    "pipeline_bytes": lambda v, name: parse_size(v, name=name),
    "tenant_quota": _no_quota, "tenant_quotas": _no_quota,
}


def redis_arguments(url: str, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(URL for redis-py, keyword arguments of the backend). Our options come from the query
    string or ``options`` (those win); the rest of the query (``db``, ``ssl_cert_reqs``,
    ``ssl_ca_certs``, ...) stays in the URL for redis-py."""
    redis_target(url)  # refused first: where the password is misread, so is the query
    _, query = split_options(url)
    mine: dict[str, Any] = {k: query[k] for k in PARSERS if k in query}
    mine.update({k: v for k, v in options.items() if v is not None})
    unknown = sorted(set(mine) - set(PARSERS))
    if unknown:
        raise ConfigError(f"unknown redis option {unknown[0]!r}")
    head, _, text = url.partition("?")  # (urlsplit().geturl() drops unix:/// slashes)
    rest = "&".join(p for p in text.split("&") if p and p.split("=")[0] not in PARSERS)
    kwargs = {name: PARSERS[name](value, f"redis {name}") for name, value in mine.items()}
    return (f"{head}?{rest}" if rest else head), kwargs


def check_options(url: str, options: dict[str, Any]) -> None:
    """The option names of a Redis tier checked as its config is built, without connecting:
    ours (names and values), and the rest of the query as redis-py's connections take it
    (``?bogus=2`` was refused only when the tier opened, in the engine's worker; a cluster's
    connections drop it unsaid)."""
    _, query = split_options(url)
    given = {k for k in query if k in PARSERS} | {k for k, v in options.items() if v is not None}
    unknown = sorted(given - set(PARSERS))
    if unknown:
        raise ConfigError(f"unknown redis option {unknown[0]!r}")
    for name in sorted(given):  # their values too: ``max_connections = 0``, a ``tenant_quota`` were
        # configs until the tier opened, in the engine's worker (reading one connects nowhere)
        PARSERS[name](query[name] if options.get(name) is None else options[name], f"redis {name}")
    head, _, text = url.partition("?")
    rest = "&".join(p for p in text.split("&") if p and p.split("=")[0] not in PARSERS)
    target = redis_target(f"{head}?{rest}" if rest else head)
    cluster = url.startswith("redis+cluster://") or _flag({**query, **options}.get("cluster"))
    if not cluster and _flag({**query, **options}.get("read_from_replicas")):
        raise ConfigError("redis read_from_replicas is for a Redis Cluster (redis+cluster://)")
    try:
        if cluster:
            check_cluster_options(target, {})
            parsed = parse_url(target)
            unknown = sorted(set(parsed) - set(cleanup_kwargs(**parsed)) - {"host", "port"})
            if unknown:
                raise ConfigError(f"unknown redis option {unknown[0]!r} (a Redis Cluster's connections ignore it)")
        else:
            pool = ConnectionPool.from_url(target)
            pool.connection_class(**pool.connection_kwargs)  # makes no connection
    except (ValueError, TypeError, RedisError) as exc:  # (RedisError: ``ssl_cert_reqs=bogus``)
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"bad Redis URL {redact_url(url)!r}: {redact_text(str(exc), url)}") from None


def _flag(value: Any) -> bool:
    """A ``cluster`` setting as a flag (one the tier refuses as it opens: none here)."""
    try:
        return value is not None and as_bool(value, "redis cluster")
    except ConfigError:
        return False


def redis_target(url: str) -> str:
    """The URL redis-py is given (a cluster's as ``redis://``). ConfigError where redis-py would
    take a piece of the password for the host or port (a ``/``, ``?`` or ``#`` left unescaped in
    it): it would quote that piece, or connect there."""
    if password_misread(url):
        raise ConfigError(f"bad Redis URL {redact_url(url)!r}: percent-encode a '/', '?' or '#' in "
                          "its password (%2F, %3F, %23)")
    _check_db(url)
    return url.replace("redis+cluster://", "redis://", 1)


def _check_db(url: str) -> None:
    """ConfigError where a TCP URL's path is not a db number, or gives one the query gives too:
    redis-py took ``/abc`` (``/O`` for ``/0``) for db 0, ``/1/2`` for db 12 and ``/1?db=3`` for
    db 3, all without a word."""
    if url.split(":", 1)[0].lower() == "unix":
        return
    try:
        path = urlsplit(url).path
    except ValueError:  # (redis-py says what is wrong with the URL)
        return
    db = unquote(path[1:])
    if db and not (db.isascii() and db.isdigit()):
        raise ConfigError(f"bad Redis URL {redact_url(url)!r}: its path names no db number")
    given = split_options(url)[1].get("db")
    if db and given is not None and not (given.strip().isascii() and given.strip().isdigit() and int(given) == int(db)):
        raise ConfigError(f"bad Redis URL {redact_url(url)!r}: two dbs are given (its path and ?db=)")


def check_cluster_options(target: str, common: dict[str, Any]) -> None:
    """Raise where redis-py's cluster client, made on first use, would refuse ``target``'s
    options (a ``db`` other than 0, a connection setting its connections do not take): that
    client connects as it is made, so without this check a bad URL is only ever "Redis down"."""
    options = parse_url(target)
    if options.get("db", 0) != 0:
        raise ConfigError("a Redis Cluster has only db 0")
    pool = ConnectionPool(**cleanup_kwargs(**{**common, **options}))  # each node's, as the client makes it
    pool.connection_class(**pool.connection_kwargs)  # makes no connection: a setting it does not take raises
