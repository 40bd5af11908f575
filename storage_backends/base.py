"""The interface every storage medium implements.

Keys and values are bytes. All calls are batched. Misses are ``None`` (get) / ``False``
(contains, put); a medium that cannot be reached raises
:class:`tiered_kv.errors.BackendUnavailable` so that the store can count it as a miss.
Implementations must be safe to call from several threads at once.

Media tell one listener (:meth:`Backend.listen`) which keys this process's calls stored and
removed (evicted to make room, deleted, withdrawn), after the fact and outside their locks: the
store turns that into block events (:mod:`tiered_kv.store.block_events`).

Every put names the tenant its values belong to (a label of at most 16 bytes, ``b""`` for none:
:mod:`storage_backends.quotas`); media that keep byte quotas per tenant evict by
:mod:`storage_backends.eviction` and report usage per tenant, the others accept the label.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

from tiered_kv.errors import ConfigError

Visitor = Callable[[int, memoryview], None]
SplitVisitor = Callable[[int, "memoryview | None", "memoryview | None"], "bool | None"]  # (i, head, value)


class Unchecked(str):
    """A line of a medium's ``check()`` answer that is no problem of the store: what that
    check could not look at (bookkeeping an older format does not keep yet), for the report."""


class RangeReader(Protocol):
    """What :meth:`Backend.visit_ranges` hands its visitor: reads of parts of the values it
    found, by index."""

    def advise(self, ranges: Iterable[tuple[int, int, int]]) -> None:
        """``(value index, start, end)`` ranges the visitor reads next: a medium reading from a
        disk starts reading them now (advice; a medium holding its values in memory ignores it)."""

    def read(self, i: int, start: int, into) -> bool | None:
        """Fill the byte buffer ``into`` with value ``i``'s bytes from ``start`` (a range inside
        the value: ValueError otherwise). True when read; False when those bytes cannot be had
        (a file cut short, a disk error: the value is damaged); None when the value is no longer
        there (deleted since the visit began: a miss, not damage). ``into`` holds bytes to
        overwrite unless True. A medium failing as a whole raises (BackendUnavailable)."""


class InMemoryRanges:
    """:class:`RangeReader` of values held in memory."""

    def __init__(self, values: list[memoryview | None]) -> None:
        self.values = values

    def advise(self, ranges: Iterable[tuple[int, int, int]]) -> None:
        pass

    def read(self, i: int, start: int, into) -> bool | None:
        value, dst = self.values[i], memoryview(into).cast("B")
        check_range(i, start, len(dst), None if value is None else len(value))
        dst[:] = value[start : start + len(dst)]
        return True


def check_range(i: int, start: int, length: int, size: int | None) -> None:
    """A :class:`RangeReader`'s check of what it is asked for: ``length`` bytes from ``start``
    inside value ``i`` of ``size`` bytes (None: absent), else ValueError (the caller's mistake)."""
    if size is None or not 0 <= start <= start + length <= size:
        raise ValueError(f"bytes {start}..{start + length} of value {i} of {size}")


Listener = Callable[[str, list[bytes]], None]  # (``"stored"`` or ``"removed"``, keys)

log = logging.getLogger(__name__)


@dataclass
class BackendStats:
    """What a medium holds and how it has been used since it was opened."""

    name: str  # medium name, e.g. "lmdb"
    url: str  # where it lives
    entries: int = 0  # values stored now
    used_bytes: int = 0  # bytes of values stored now
    capacity_bytes: int | None = None  # byte capacity; None when the medium decides (Redis)
    gets: int = 0  # keys asked for
    hits: int = 0  # keys found
    puts: int = 0  # values stored
    put_rejected: int = 0  # values refused (no room, too large, medium down)
    deletes: int = 0  # values deleted on request
    evictions: int = 0  # values evicted to make room
    bytes_in: int = 0  # bytes written
    bytes_out: int = 0  # bytes read
    errors: int = 0  # calls that failed because the medium was unavailable
    extra: dict = field(default_factory=dict)  # medium-specific figures (``quota_evictions``: the
    #                                            evictions a tenant's quota made, among ``evictions``)

    def as_dict(self) -> dict:
        return asdict(self)


class TenantTotal(NamedTuple):
    """What one tenant holds in a medium now."""

    used_bytes: int
    entries: int


class Backend(ABC):
    """One storage medium. Subclasses set ``name`` and implement the abstract methods."""

    name: str = "backend"
    store_signature: str | None = None  # what marks a store of this medium in a directory (messages)
    listener: Listener | None = None  # told of stored and removed keys (:meth:`listen`)
    takes_gathered: bool = False  # put_many takes storage_backends.gathered.Gathered values
    told_capacity: int | None = None  # a tool's open of a medium that then evicts to no capacity
    #                                   (lmdb's): the capacity it was given, read as the medium reads it

    def __init__(self, url: str) -> None:
        self.url = url
        self._stats_lock = threading.Lock()
        self._counters = BackendStats(name=self.name, url=url)

    # -- recognising and opening existing stores (tools) -------------------------------------
    @classmethod
    def store_url_at(cls, path: Path) -> str | None:
        """The URL of a store of this medium in directory ``path``; None when there is none (the
        default: media that keep nothing in directories)."""
        return None

    @classmethod
    def store_files(cls, path: Path) -> list[Path]:
        """The files a store of this medium keeps in directory ``path`` (none by default)."""
        return []

    @classmethod
    def open_read_only(cls, url: str, *, options: dict | None = None, timeout: float = 5.0) -> Backend:
        """Open the existing store at ``url`` for tools: never create one, never record accesses
        (no LRU order or hit count changes), and for remote media no retries and ``timeout``
        seconds per call. What the tool itself asks for (a delete) still happens. ``options``:
        the engine's settings for the medium (as :meth:`from_url`'s keywords, over the query),
        read and refused by the medium; the settings the rules above fix (recording accesses,
        creating, timeout, retries) are the tool's. ConfigError when ``url`` names no store of
        this medium."""
        raise ConfigError(f"{cls.name} stores cannot be opened by tools")

    @classmethod
    def create_for_tool(cls, url: str, *, room: int = 0) -> Backend:
        """A new store at ``url`` for a tool to fill (``copy``) with about ``room`` bytes: as the
        medium creates one, but bounded only by what the URL asks (a tool does not know the
        engine's capacity). By default the medium's own opening."""
        return cls.from_url(url)

    # -- the interface ----------------------------------------------------------------------
    @abstractmethod
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Values of ``keys`` (None where absent), in order."""

    @abstractmethod
    def put_many(self, items: Sequence[tuple[bytes, bytes]], tenant: bytes = b"") -> list[bool]:
        """Store each (key, value) for ``tenant``; True where stored. Evicts to make room (a
        tenant over its quota only its own entries); never raises for lack of room (False
        instead). Overwrites an existing key (whoever's it was)."""

    @abstractmethod
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is present. No side effects (no LRU touch)."""

    @abstractmethod
    def delete_many(self, keys: Sequence[bytes]) -> int:
        """Delete ``keys``; returns how many were present."""

    @abstractmethod
    def scan(self, prefix: bytes = b"") -> Iterator[bytes]:
        """Every key that starts with ``prefix`` (no order promised)."""

    @abstractmethod
    def stats(self) -> BackendStats:
        """Current figures (entries, used bytes, counters)."""

    @abstractmethod
    def close(self) -> None:
        """Release the medium; further calls are errors. Idempotent."""

    # -- optional fast paths, with generic defaults ----------------------------------------
    def visit_many(self, keys: Sequence[bytes], visitor: Visitor) -> list[bool]:
        """Call ``visitor(i, value)`` for each present key; the buffer is only valid during
        the call (zero-copy media pass their own memory). Returns presence per key."""
        found = []
        for i, value in enumerate(self.get_many(keys)):
            if value is not None:
                visitor(i, memoryview(value))
            found.append(value is not None)
        return found

    def visit_split(self, keys: Sequence[bytes], outs: Sequence[object], visitor: SplitVisitor) -> list[bool]:
        """Like :meth:`visit_many`, for readers whose values end with ``len(outs[i])`` bytes they
        want in ``outs[i]``: a medium that can read a value in pieces reads its first bytes into
        a buffer and the rest straight into ``outs[i]``, then calls ``visitor(i, head, None)``;
        a visitor answering False did not want it that way, and is called again as
        ``visitor(i, None, value)`` with the whole value (so is every value a medium does not
        split: this default splits none). Returns presence per key."""
        return self.visit_many(keys, lambda i, value: visitor(i, None, value))

    def visit_ranges(self, keys: Sequence[bytes], visitor: Callable[[list[int | None], RangeReader], None]) -> list[bool]:
        """Call ``visitor(sizes, reader)`` once, with every key's value length (None where
        absent) and a :class:`RangeReader` of those values, valid during the call: a reader that
        works through many values in several passes (layer group by layer group) reads each
        part when it needs it, straight into its place, and asks for the parts it reads next
        first (``reader.advise``), so what it needs first arrives first. Returns presence per
        key (as it was when the visit began)."""
        values = [None if v is None else memoryview(v).cast("B") for v in self.get_many(keys)]
        visitor([None if v is None else len(v) for v in values], InMemoryRanges(values))
        return [v is not None for v in values]

    # -- tenants: media that keep no figures per tenant answer None ------------------------------
    def tenant_totals(self) -> dict[bytes, TenantTotal] | None:
        """Bytes and entries per tenant label now (tenants holding nothing are left out)."""
        return None

    def tenant_usage(self) -> dict[bytes, int] | None:
        """Bytes stored per tenant label now."""
        totals = self.tenant_totals()
        return None if totals is None else {tenant: t.used_bytes for tenant, t in totals.items()}

    # -- optional hooks: deliberately empty, a medium overrides those that apply to it ------
    def flush(self) -> None:  # noqa: B027  # optional hook, no-op by default
        """Make every completed put durable (no-op for media without a notion of it)."""

    def pin_many(self, keys: Sequence[bytes]) -> None:  # noqa: B027  # optional hook, no-op by default
        """Protect ``keys`` from eviction by this process until :meth:`unpin_many` (no-op for
        media that evict by their own policy, or not at all)."""

    def unpin_many(self, keys: Sequence[bytes]) -> None:  # noqa: B027  # optional hook, no-op by default
        """Undo one :meth:`pin_many` of each key."""

    def listen(self, listener: Listener | None) -> None:
        """Have ``listener(change, keys)`` told which keys this process's calls ``"stored"`` and
        ``"removed"`` (evicted, deleted, withdrawn), in the order they happened, after the fact;
        ``"lost"`` (no keys) where the medium noticed it lost everything (a flushed Redis).
        One listener per medium (None: nobody). What other processes do, and what a medium
        drops by its own policy (Redis ``maxmemory``, TTLs), is not seen. The listener may be
        called under the medium's own locks: it must be quick and never call the medium."""
        self.listener = listener

    # -- helpers for subclasses ------------------------------------------------------------
    def _tell_in_order(self, changes: Sequence[tuple[str, bytes]]) -> None:
        """Tell ``(change, key)`` pairs in their order, a run of one kind at a time."""
        if self.listener is None:
            return
        start = 0
        for i in range(1, len(changes) + 1):
            if i == len(changes) or changes[i][0] != changes[start][0]:
                self._tell(changes[start][0], [bytes(k) for _, k in changes[start:i]])
                start = i

    def _tell(self, change: str, keys: Sequence[bytes]) -> None:
        """Tell the listener (if any) of ``keys`` stored or removed; a failing listener is logged."""
        listener = self.listener
        if listener is None or not keys:
            return
        try:
            listener(change, list(keys))
        except Exception:
            log.exception("%s: block listener failed", self.name)

    def _get_by_visiting(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """``get_many`` for media whose native read is :meth:`visit_many` (copies each value)."""
        out: list[bytes | None] = [None] * len(keys)

        def keep(i: int, value: memoryview) -> None:
            out[i] = bytes(value)

        self.visit_many(keys, keep)
        return out

    def _count(self, **deltas: int) -> None:
        """Add to the counters; names that are no field of BackendStats count in ``extra``."""
        with self._stats_lock:
            for name, delta in deltas.items():
                if hasattr(self._counters, name):
                    setattr(self._counters, name, getattr(self._counters, name) + delta)
                else:
                    self._counters.extra[name] = self._counters.extra.get(name, 0) + delta

    def figures(self) -> BackendStats:
        """Entries, used bytes and capacity with the counters, as cheaply as the medium can give
        them (what a metrics scrape reads); :meth:`stats` unless a medium knows a cheaper way."""
        return self.stats()

    def counters(self) -> BackendStats:
        """What this backend has counted so far (puts, evictions, quota evictions, ...), from
        memory: no call to the medium (unlike :meth:`stats`, which may ask a server or walk files)."""
        return self._snapshot()

    def _snapshot(self, **current) -> BackendStats:
        with self._stats_lock:
            counted = self._counters.as_dict()
        extra = {**counted.pop("extra"), **current.pop("extra", {})}
        return BackendStats(**{**counted, **current}, extra=extra)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
