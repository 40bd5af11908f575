"""Remote tier: Redis (``redis://``, ``rediss://`` TLS, ``unix://``) or Redis Cluster.

Values live under ``prefix + key`` (binary-safe), optionally with a TTL (``SET .. PX``); Redis' own
``maxmemory`` policy evicts. Transfer shapes follow loopback measurements (redis-py 8 + hiredis, 2 vCPUs):
SETs and GETs go in pipelines of about ``pipeline_bytes`` (4 MiB) of values, GETs sized by the value size
seen so far, so 2 MiB values travel two at a time and 64 KiB ones 64 at a time. Against one command per
value that made GETs 1.8x (2 MiB) to 3.5x (64 KiB) and 64 KiB SETs 2x faster (2 MiB SETs: the same);
32-deep pipelines of 2 MiB values and MGET (one multi-value reply) are slower. Commands are packed without
copying large values (``storage_backends.redis_packer``), a raw block's payload sent straight from its
host slot; URL options are read by ``storage_backends.redis_options``.

Failures are misses: refused or dropped connections are retried with exponential backoff (redis-py's
``Retry``: at most ``retries`` more tries), a timeout is not (a server that did not answer in ``timeout``
seconds is hung or black-holed; asking again only doubles the wait; the clients:
:mod:`storage_backends.redis_clients`); then the call raises :class:`BackendUnavailable` (a refused user
or password: :class:`CredentialsRefused`, one) and the circuit breaker opens (each call runs through
:mod:`storage_backends.redis_calls`, errors as :mod:`storage_backends.redis_errors` says; the breaker:
:mod:`storage_backends.redis_breaker`). While
it is open every call fails at once, and one background probe (a PING, every cool-down that doubles from
0.5 s to 4 s; in a cluster to every master) watches for Redis to come back and closes it: no caller ever
waits on a probe, and the same object works again on its own once Redis is healthy. In a cluster GETs,
TYPEs, SETs and UNLINKs go one pipeline per node (at once with ``node_threads``;
:mod:`storage_backends.redis_node_pipelines`), so a hung node costs a call one timeout there too; SCAN and
INFO are retried as whole calls (:mod:`storage_backends.redis_admin`). ``maxmemory`` refusals (OOM) make
that put ``False`` (``put_rejected``), as do ``READONLY`` and ``MISCONF``, which other calls raise as
:class:`BackendError`. A call finding all ``max_connections`` busy waits for one (:mod:`storage_backends.redis_pool`).
``close()`` closes every connection, those a call or probe running meanwhile puts back too. Every call ends by a
deadline (:mod:`storage_backends.redis_deadline`); a lost keyspace is heard (:mod:`storage_backends.redis_epoch`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ResponseError

from storage_backends.base import Backend, BackendStats, Visitor
from storage_backends.log_throttle import LogThrottle
from storage_backends.quotas import as_tenant
from storage_backends.redaction import redact_url
from storage_backends.redis_admin import AdminRetry
from storage_backends.redis_calls import RedisCalls
from storage_backends.redis_clients import make_client, takes_gathered
from storage_backends.redis_epoch import EpochWatch
from storage_backends.redis_errors import DOWN_ERRORS
from storage_backends.redis_figures import server_facts
from storage_backends.redis_names import RedisNames
from storage_backends.redis_node_pipelines import NodeFanout, name_of, node_pipelines
from storage_backends.redis_options import check_counts, redis_arguments, redis_target
from storage_backends.redis_packer import nbytes
from tiered_kv.errors import BackendError, BackendUnavailable, ConfigError

log = logging.getLogger(__name__)
_refusals = LogThrottle(log)  # a read-only replica or a failing RDB save refuses every value

T = TypeVar("T")
PIPELINE_BYTES = 4 << 20  # default: bytes of values per pipeline of SETs or GETs
VALUE_SIZE_GUESS = 2 << 20  # value size assumed until some are seen (sizes the first GETs)
KEYS_PER_CALL = 1000  # keys per TYPE pipeline, UNLINK and SCAN page


class RedisBackend(Backend):
    name = "redis"
    epoch: EpochWatch | None = None  # looks for a lost keyspace once a listener is set

    def __init__(self, url: str, *, prefix: bytes | str = b"tkv:", ttl: float | None = None,
                 timeout: float = 2.0, retries: int = 2, max_connections: int = 64, cluster: bool = False,
                 pipeline_bytes: int = PIPELINE_BYTES, read_from_replicas: bool = False,
                 node_threads: int = 0) -> None:
        super().__init__(redact_url(url))  # stats and logs never show a password
        check_counts(retries, max_connections, node_threads)  # (each within its bounds)
        if timeout <= 0 or pipeline_bytes < 1:
            raise ConfigError("redis timeout and pipeline_bytes must be positive")
        self.prefix = prefix.encode() if isinstance(prefix, str) else bytes(prefix)
        self.ttl_ms = max(1, round(ttl * 1000)) if ttl else None
        self.timeout, self.pipeline_bytes = timeout, pipeline_bytes
        self.cluster = cluster or url.startswith("redis+cluster://")
        if read_from_replicas and not self.cluster:
            raise ConfigError("redis read_from_replicas is for a Redis Cluster (redis+cluster://)")
        self.names = RedisNames(self.prefix, self.cluster)  # key names (no accidental hash tags)
        self._value_size = float(VALUE_SIZE_GUESS)  # running estimate: sizes GET pipelines
        # connection errors are retried, timeouts are not (storage_backends.redis_clients)
        self.retries, self._backoff = retries, ExponentialBackoff(cap=min(0.5, timeout), base=0.02)
        self._fanout = NodeFanout(node_threads)  # threads sending a cluster call's nodes at once
        target = redis_target(url)
        self.takes_gathered = takes_gathered(target, self.cluster)  # (raw blocks as head + host slot)
        client, make_cluster = make_client(url, target, cluster=self.cluster, timeout=timeout, retries=retries,
                                           max_connections=max_connections, backoff=self._backoff,
                                           read_from_replicas=read_from_replicas)
        # the calls to the server: behind the breaker, within a deadline, redis-py's errors turned into ours
        self._calls = RedisCalls(self.url, timeout=timeout, client=client, make_cluster=make_cluster,
                                 balanced=read_from_replicas, admin=AdminRetry(self._backoff, retries), count=self._count)
        if not redis.utils.HIREDIS_AVAILABLE:
            log.warning("hiredis is not installed: Redis reads will be several times slower "
                        "(pip install 'redis[hiredis]')")
        log.info("redis tier at %s (prefix %r, ttl %s, cluster %s)", self.url, self.prefix,
                 f"{self.ttl_ms} ms" if self.ttl_ms else "none", self.cluster)

    def listen(self, listener: Any) -> None:  # (and a lost keyspace is "lost": .redis_epoch)
        super().listen(listener)
        self.epoch = self.epoch or (EpochWatch(self) if listener is not None else None)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisBackend:
        """Our options from the query string or keywords (keywords win); the rest (``db``, ``ssl_*``) to redis-py."""
        target, kwargs = redis_arguments(url, options)
        return cls(target, **kwargs)

    @classmethod
    def open_read_only(cls, url: str, *, options: dict | None = None, timeout: float = 5.0) -> RedisBackend:
        """``url`` with ``options`` (the engine's: a tool's SETs get its ttl), but ``timeout`` s a call, no retries."""
        return cls.from_url(url, **{**(options or {}), "timeout": timeout, "retries": 0})

    @property
    def client(self) -> Any:
        """The redis-py client (a cluster's is made, and connects, on first use)."""
        return self._calls.client

    # -- the breaker (storage_backends.redis_calls) ------------------------------------------
    @property
    def available(self) -> bool:
        """False while the breaker is open (calls fail at once until a probe gets an answer)."""
        return self._calls.available

    @property
    def _failures(self) -> int:  # consecutive failed calls and probes (0: the breaker is closed)
        return self._calls.breaker.failures

    @property
    def _breaker(self) -> Any:
        return self._calls.breaker

    @property
    def _closed(self) -> bool:
        return self._calls.closed

    @property
    def _client(self) -> Any:  # (None until a cluster's is made)
        return self._calls.made

    def _call(self, fn: Callable[[Any], T], *, admin: bool = False) -> T:
        """``fn(client)`` behind the breaker (``admin``: SCAN, INFO); Redis away raises BackendUnavailable."""
        return self._calls.call(fn, admin=admin)

    def _ping(self) -> None:  # (what the breaker's probe asks)
        self._calls.ping()

    # -- reads -------------------------------------------------------------------------------
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(keys)
        self.visit_many(keys, lambda i, value: out.__setitem__(i, value.obj))
        return out

    def visit_many(self, keys: Sequence[bytes], visitor: Visitor) -> list[bool]:
        """Pipelined GETs of about ``pipeline_bytes`` of values, by the value size seen so far;
        the visitor sees a batch before the next is asked for (a failure keeps what was seen).
        A key that holds no string (someone else's) is a miss."""
        found = [False] * len(keys)
        start = 0
        while start < len(keys):
            per_call = max(1, int(self.pipeline_bytes // self._value_size))
            names = self.names.names(keys[start : start + per_call])
            values = self._call(lambda c, n=names: self._pipelined(c, n, lambda p, name: p.get(name)))
            hits = [(i, v) for i, v in enumerate(values, start) if isinstance(v, bytes)]
            self._count(gets=len(names), hits=len(hits), bytes_out=sum(len(v) for _, v in hits))
            if hits:  # the largest: a pipeline too short costs less than one too long
                self._value_size = (self._value_size + max(len(v) for _, v in hits)) / 2
            for i, value in hits:
                found[i] = True
                visitor(i, memoryview(value))
            start += len(names)
        return found

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """TYPE per key, ``KEYS_PER_CALL`` a pipeline: one holding no string (someone else's) is absent."""
        out: list[bool] = []
        for start in range(0, len(keys), KEYS_PER_CALL):
            names = self.names.names(keys[start : start + KEYS_PER_CALL])
            replies = self._call(lambda c, n=names: self._pipelined(c, n, lambda p, name: p.type(name)))
            if refused := next((r for r in replies if isinstance(r, ResponseError)), None):  # (NOPERM)
                raise BackendUnavailable(f"redis at {self.url} refused TYPE: {refused}")  # not "all absent"
            out += [r in (b"string", "string") for r in replies]
        return out

    def _pipelined(self, client: Any, items: Sequence, add: Callable[[Any, Any], Any], *, read: bool = True,
                   refusals: bool = False, passed: tuple[type[Exception], ...] = ()) -> list:
        """One pipeline of ``add(pipe, item)`` per item (a key name, or a (name, value) pair); in a cluster
        one per node (:mod:`storage_backends.redis_node_pipelines`); ``refusals`` raised too, ``passed`` not."""
        if self.cluster:
            replies = node_pipelines(client, items, name_of, add, read=read, retries=self.retries,
                                     backoff=self._backoff.compute, fanout=self._fanout)
        else:
            pipe = client.pipeline(transaction=False)
            for item in items:
                add(pipe, item)
            replies = pipe.execute(raise_on_error=False)
        down = next((r for r in replies if isinstance(r, DOWN_ERRORS + (ResponseError,) * refusals)
                     and not isinstance(r, passed)), None)
        if down is not None:  # e.g. CLUSTERDOWN answered per command; with ``refusals`` READONLY too
            raise down
        return replies

    # -- writes ------------------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[bytes, bytes]], tenant: bytes = b"") -> list[bool]:
        """Pipelines of SETs of at most ``pipeline_bytes`` of values (a larger value alone).
        The tenant label is checked and not kept: Redis evicts by its own policy."""
        as_tenant(tenant)
        stored: list[bool] = []
        batch: list[tuple[bytes, Any]] = []
        size = 0
        for key, value in items:
            if batch and size + nbytes(value) > self.pipeline_bytes:
                stored += self._set_batch(batch)
                batch, size = [], 0
            batch.append((key, value))
            size += nbytes(value)
        return stored + self._set_batch(batch)

    def _set_batch(self, batch: list[tuple[bytes, Any]]) -> list[bool]:
        """One pipeline of SETs; refusals (OOM when over ``maxmemory``) are False."""
        if not batch:
            return []
        names, values = self.names.names(k for k, _ in batch), [v for _, v in batch]
        pairs = list(zip(names, values))  # a lone value is a lone SET on the wire
        replies = self._call(lambda c: self._pipelined(c, pairs, lambda p, kv: p.set(*kv, px=self.ttl_ms), read=False))
        ok = [r is True or r == b"OK" for r in replies]
        for reply in (r for r in replies if isinstance(r, ResponseError)):  # OOM: no room; others said rarely
            say = log.debug if isinstance(reply, redis.exceptions.OutOfMemoryError) else _refusals.warning
            say("redis at %s refused a value: %s", self.url, reply)
        self._count(puts=sum(ok), put_rejected=len(ok) - sum(ok),
                    bytes_in=sum(nbytes(v) for v, s in zip(values, ok) if s))
        self._value_size = (self._value_size + max(map(nbytes, values))) / 2
        self._tell("stored", [k for (k, _), s in zip(batch, ok) if s])
        return ok

    def delete_many(self, keys: Sequence[bytes]) -> int:
        """UNLINK, ``KEYS_PER_CALL`` keys a call, each call's keys told removed once it ran (UNLINK
        counts, it does not name: every key asked for). A call that fails part-way raises: the calls
        before were told, and the failed one when it was sent (a timeout, a dropped connection)."""
        n = 0
        try:
            for start in range(0, len(keys), KEYS_PER_CALL):
                chunk = keys[start : start + KEYS_PER_CALL]
                sent = self.available  # an open breaker refuses a call before sending it
                try:
                    n += self._unlink(self.names.names(chunk))
                except BackendUnavailable:  # (a refusal, READONLY or NOPERM, ran nowhere: not told)
                    if sent:
                        self._tell("removed", chunk)
                    raise
                self._tell("removed", chunk)
        finally:
            self._count(deletes=n)
        return n

    def _unlink(self, names: list[bytes]) -> int:
        if self.cluster:  # one pipeline per node, retried as GETs and SETs are; a node's refusal raises
            replies = self._call(lambda c: self._pipelined(c, names, lambda p, n: p.unlink(n), read=False, refusals=True))
            return sum(r for r in replies if isinstance(r, int))
        return int(self._call(lambda c: c.unlink(*names)))

    # -- listing and figures -----------------------------------------------------------------
    def scan(self, prefix: bytes = b"") -> Iterator[bytes]:
        """SCAN MATCH of our prefix + ``prefix`` (glob escaped); a key SCAN returns twice is one."""
        names: set[bytes] = set()
        for pattern in self.names.patterns(prefix):
            names |= self._call(lambda c, p=pattern: set(c.scan_iter(match=p, count=KEYS_PER_CALL)), admin=True)
        return iter(sorted({self.names.key(n) for n in names}))

    def stats(self) -> BackendStats:
        """``entries``: keys under our prefix, exact when the database holds at most
        ``ENTRY_SAMPLE`` keys, else our share of a SCAN sample of that many keys times the key
        count (``extra['entries_exact']``; :mod:`storage_backends.redis_figures`). ``used_bytes``:
        the server's ``used_memory`` (every key plus Redis' overhead, ~1.25x payload); ``capacity_bytes``:
        ``maxmemory`` or None. Redis away (or refusing INFO): the counters, ``extra['unavailable']``."""
        try:
            facts = self._call(lambda c: server_facts(c, self.prefix), admin=True)
        except BackendError as exc:  # the counters are most wanted when Redis is away
            return self._snapshot(extra={"unavailable": str(exc), "breaker_failures": self._failures})
        return self._snapshot(
            entries=facts.pop("entries"), used_bytes=facts.pop("used_memory"),
            capacity_bytes=facts.pop("maxmemory") or None,
            extra={**facts, "hiredis": bool(redis.utils.HIREDIS_AVAILABLE), "cluster": self.cluster,
                   "prefix": self.prefix.decode("latin-1"), "used_bytes_is": "server used_memory",
                   "pipeline_bytes": self.pipeline_bytes, "breaker_failures": self._failures})

    def close(self) -> None:
        if self.epoch is not None:  # (its thread ends now; every close here is idempotent)
            self.epoch.close()
        self._calls.close()  # (calls refused, the probe stopped)
        self._fanout.close()  # (before the client: no pipeline runs on a closed client)
        self._calls.disconnect()  # (again by a call or probe still running: RedisCalls.drop_if_closed)
