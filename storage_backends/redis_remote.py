"""Remote tier: Redis (``redis://``, ``rediss://`` TLS, ``unix://``) or Redis Cluster.

Values live under ``prefix + key`` (binary-safe), optionally with a TTL; Redis' own
``maxmemory`` policy evicts. Large values go one command at a time over pooled connections
(pipelining multi-MiB values is slower than not, see shared/limits.md); small values are
pipelined in batches of a few MiB. Connection failures and timeouts are retried with exponential
backoff, then raise :class:`BackendUnavailable`; a circuit breaker then fails calls at once for a
growing cool-down, so a dead Redis costs no timeouts in the engine's path, and the same object
works again once Redis is back. ``maxmemory`` refusals (OOM) make a put ``False``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterator, Sequence, TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from storage_backends.base import Backend, BackendStats
from storage_backends.registry import split_options
from tiered_kv.errors import BackendUnavailable, ConfigError
from tiered_kv.units import parse_duration

log = logging.getLogger(__name__)

T = TypeVar("T")
DOWN_ERRORS = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, OSError)
LARGE_VALUE = 512 << 10  # values from this size are sent one command at a time
PIPELINE_BYTES = 4 << 20  # bytes of small values per pipeline
COOLDOWN_MIN, COOLDOWN_MAX = 0.5, 8.0  # seconds the breaker stays open after a failure
OUR_OPTIONS = ("prefix", "ttl", "timeout", "retries", "max_connections", "cluster")


def _glob_escape(data: bytes) -> bytes:
    out = bytearray()
    for byte in data:
        if byte in b"*?[]\\":
            out.append(0x5C)
        out.append(byte)
    return bytes(out)


class RedisBackend(Backend):
    name = "redis"

    def __init__(self, url: str, *, prefix: bytes | str = b"tkv:", ttl: float | None = None,
                 timeout: float = 2.0, retries: int = 2, max_connections: int = 32,
                 cluster: bool = False) -> None:
        super().__init__(url)
        self.prefix = prefix.encode() if isinstance(prefix, str) else bytes(prefix)
        self.ttl_ms = None if ttl is None else max(1, int(ttl * 1000))
        self.timeout = timeout
        retry = Retry(ExponentialBackoff(cap=min(1.0, timeout), base=0.02), retries)
        common = dict(socket_timeout=timeout, socket_connect_timeout=timeout, retry=retry,
                      retry_on_error=[RedisConnectionError, RedisTimeoutError, BusyLoadingError])
        base, _ = split_options(url)
        try:
            if cluster or base.startswith("redis+cluster://"):
                from redis.cluster import RedisCluster

                self.client = RedisCluster.from_url(base.replace("redis+cluster://", "redis://", 1),
                                                    **common)
            else:
                self.client = redis.Redis.from_url(url, max_connections=max_connections, **common)
        except (ValueError, redis.RedisError) as exc:
            raise ConfigError(f"bad Redis URL {url!r}: {exc}") from None
        if not redis.utils.HIREDIS_AVAILABLE:
            log.warning("hiredis is not installed: Redis reads will be several times slower "
                        "(pip install 'redis[hiredis]')")
        self._breaker = threading.Lock()
        self._down_until = 0.0
        self._cooldown = COOLDOWN_MIN
        self._closed = False
        log.info("redis tier at %s (prefix %r, ttl %s)", _redacted(url), self.prefix,
                 "none" if ttl is None else f"{ttl}s")

    @classmethod
    def from_url(cls, url: str, **options) -> "RedisBackend":
        _, query = split_options(url)
        mine = {k: query[k] for k in OUR_OPTIONS if k in query}
        mine.update({k: v for k, v in options.items() if v is not None})
        unknown = sorted(set(mine) - set(OUR_OPTIONS))
        if unknown:
            raise ConfigError(f"unknown redis option {unknown[0]!r}")
        # redis-py parses its own query options (ssl_cert_reqs, db, ...); ours are removed
        head, _, query_text = url.partition("?")  # (urlsplit().geturl() would drop unix:// slashes)
        rest = "&".join(p for p in query_text.split("&") if p and p.split("=")[0] not in OUR_OPTIONS)
        url = f"{head}?{rest}" if rest else head
        kwargs: dict = {}
        if "prefix" in mine:
            kwargs["prefix"] = str(mine["prefix"])
        if mine.get("ttl") not in (None, "", "none"):
            kwargs["ttl"] = parse_duration(mine["ttl"], name="redis ttl")
        if "timeout" in mine:
            kwargs["timeout"] = parse_duration(mine["timeout"], name="redis timeout")
        try:
            if "retries" in mine:
                kwargs["retries"] = int(mine["retries"])
            if "max_connections" in mine:
                kwargs["max_connections"] = int(mine["max_connections"])
        except ValueError as exc:
            raise ConfigError(f"redis option: {exc}") from None
        if "cluster" in mine:
            kwargs["cluster"] = str(mine["cluster"]).lower() in ("1", "true", "yes", "on")
        return cls(url, **kwargs)

    # -- the breaker -------------------------------------------------------------------------
    def _call(self, fn: Callable[[], T]) -> T:
        if self._closed:
            raise ValueError("redis backend is closed")
        now = time.monotonic()
        with self._breaker:
            if now < self._down_until:
                self._count(errors=1)
                raise BackendUnavailable(f"redis at {_redacted(self.url)} is down (retrying in "
                                         f"{self._down_until - now:.1f}s)")
        try:
            result = fn()
        except DOWN_ERRORS as exc:
            with self._breaker:
                self._down_until = time.monotonic() + self._cooldown
                self._cooldown = min(COOLDOWN_MAX, self._cooldown * 2)
            self._count(errors=1)
            log.warning("redis at %s unavailable: %s", _redacted(self.url), exc)
            raise BackendUnavailable(f"redis at {_redacted(self.url)} unavailable: {exc}") from None
        with self._breaker:
            self._cooldown = COOLDOWN_MIN
        return result

    def _k(self, key: bytes) -> bytes:
        return self.prefix + key

    # -- the interface -----------------------------------------------------------------------
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        out: list[bytes | None] = []
        for start in range(0, len(keys), 8):  # bounded replies; one round trip per 8 keys
            chunk = keys[start : start + 8]
            out.extend(self._call(lambda c=chunk: self.client.mget([self._k(k) for k in c])))
        hits = [v for v in out if v is not None]
        self._count(gets=len(keys), hits=len(hits), bytes_out=sum(len(v) for v in hits))
        return out

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        stored: list[bool] = []
        small: list[tuple[bytes, bytes]] = []
        size = 0
        for key, value in items:
            if len(value) >= LARGE_VALUE:
                stored.extend(self._flush_small(small))
                small, size = [], 0
                stored.append(self._set_one(key, value))
                continue
            small.append((key, value))
            size += len(value)
            if size >= PIPELINE_BYTES:
                stored.extend(self._flush_small(small))
                small, size = [], 0
        stored.extend(self._flush_small(small))
        ok = sum(stored)
        self._count(puts=ok, put_rejected=len(stored) - ok,
                    bytes_in=sum(len(v) for (_, v), s in zip(items, stored) if s))
        return stored

    def _set_one(self, key: bytes, value: bytes) -> bool:
        try:
            return bool(self._call(lambda: self.client.set(self._k(key), value, px=self.ttl_ms)))
        except ResponseError as exc:  # OOM command not allowed when used memory > 'maxmemory'
            log.warning("redis refused a %d-byte value: %s", len(value), exc)
            return False

    def _flush_small(self, batch: list[tuple[bytes, bytes]]) -> list[bool]:
        if not batch:
            return []

        def run() -> list:
            pipe = self.client.pipeline(transaction=False)
            for key, value in batch:
                pipe.set(self._k(key), value, px=self.ttl_ms)
            return pipe.execute(raise_on_error=False)

        results = self._call(run)
        return [r is True or r == b"OK" for r in results]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []

        def run() -> list:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._k(key))
            return pipe.execute()

        return [bool(n) for n in self._call(run)]

    def delete_many(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        n = int(self._call(lambda: self.client.unlink(*[self._k(k) for k in keys])))
        self._count(deletes=n)
        return n

    def scan(self, prefix: bytes = b"") -> Iterator[bytes]:
        pattern = _glob_escape(self.prefix + prefix) + b"*"
        keys = self._call(lambda: list(self.client.scan_iter(match=pattern, count=1000)))
        cut = len(self.prefix)
        return iter([k[cut:] for k in keys])

    def stats(self) -> BackendStats:
        def info() -> dict:
            memory = self.client.info("memory")
            server = self.client.info("server")
            return {"used": memory.get("used_memory", 0), "maxmemory": memory.get("maxmemory", 0),
                    "policy": memory.get("maxmemory_policy"), "version": server.get("redis_version")}

        facts = self._call(info)
        entries = sum(1 for _ in self.scan())
        return self._snapshot(
            entries=entries, used_bytes=int(facts["used"]),
            capacity_bytes=int(facts["maxmemory"]) or None,
            extra={"used_bytes_is": "server used_memory (all keys)", "entries_is": "SCAN of our prefix",
                   "maxmemory_policy": facts["policy"], "server_version": facts["version"],
                   "hiredis": bool(redis.utils.HIREDIS_AVAILABLE), "prefix": self.prefix.decode("latin-1")})

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.client.close()
        except redis.RedisError:
            pass


def _redacted(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        return parts._replace(netloc=netloc).geturl()
    return url
