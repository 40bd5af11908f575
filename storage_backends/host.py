"""Host tier: a slab of fixed-size slots in CPU memory (page-locked when CUDA is present).

The store uses the slot interface: ``reserve_many`` (phase one: slots handed out, keys not
visible), ``commit_many`` / ``abort_many`` (phase two), ``pin_many`` / ``unpin_many`` (leases:
never evicted or reused) and ``slot_view`` (a uint8 tensor over a slot).
Eviction (:mod:`storage_backends.eviction`) is LRU over committed, unpinned entries when no slot
is free; a tenant over its ``tenant_quota`` (bytes of the lengths its entries were reserved
with) evicts its own entries first. ``on_evict(key, bytes, tenant)`` sees an entry before its
slot is reused (the store uses it for the ``on_evict`` write-behind policy); the listener
(:meth:`Backend.listen`) hears of commits and of evictions, deletes and withdrawals. Tenant
figures live in memory only."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence

import torch

from storage_backends.base import Backend, BackendStats, TenantTotal, Visitor
from storage_backends.eviction import Eviction, Plan
from storage_backends.eviction_lru import LRU
from storage_backends.host_entries import HostEntry, reserve_free
from storage_backends.host_evictions import EvictHook, PendingEvictions
from storage_backends.host_slab import new_slab, no_slab, settle_copies, want_pinned
from storage_backends.options import split_options
from storage_backends.quotas import Quotas, as_tenant
from storage_backends.recency import RecencyIndex
from tiered_kv.errors import BackendClosed, ConfigError
from tiered_kv.units import format_size, parse_size

log = logging.getLogger(__name__)


class HostBackend(Backend):
    name = "host"

    def __init__(self, *, capacity: int, slot_bytes: int, pinned: str | bool = "auto",
                 url: str = "host://", on_evict: EvictHook | None = None,
                 tenant_quota: int | str | None = None, tenant_quotas=None) -> None:
        super().__init__(url)
        self.quotas = Quotas.from_options("host", tenant_quota, tenant_quotas)
        self.tenant_quota = self.quotas.default
        if slot_bytes <= 0:
            raise ConfigError(f"host slot size must be positive, got {slot_bytes}")
        self.slot_bytes = slot_bytes
        self.num_slots = capacity // slot_bytes
        self.capacity = self.num_slots * slot_bytes
        self.pinned = want_pinned(pinned)
        self.slab = new_slab(self.num_slots, slot_bytes, self.pinned)
        log.info("host tier: %d slots x %s = %s (%s)", self.num_slots, format_size(slot_bytes),
                 format_size(self.capacity), "pinned" if self.pinned else "pageable")
        self._np, self._lock = self.slab.numpy(), threading.Lock()
        self._entries: dict[bytes, HostEntry] = {}
        self._recency = RecencyIndex(self._held)  # every entry, reserved ones included
        self._eviction = Eviction(LRU, None, self.quotas)  # capacity: the slots
        self._counters.extra["quota_evictions"] = 0
        self._free, self._ready, self._leased = list(range(self.num_slots - 1, -1, -1)), 0, 0  # (pop order), committed, leased
        self.on_evict = on_evict
        self._evicting = PendingEvictions()  # evicted bytes on their way to ``on_evict``
        self._closed = False

    @classmethod
    def from_url(cls, url: str, **options) -> HostBackend:
        _, query = split_options(url)
        query.update(options)
        capacity = parse_size(query.pop("capacity", 1 << 30), name="host capacity")
        slot = parse_size(query.pop("slot", query.pop("slot_bytes", 2 << 20)), name="host slot")
        known = {k: query.pop(k) for k in ("pinned", "on_evict", "tenant_quota", "tenant_quotas") if k in query}
        if query:
            raise ConfigError(f"unknown host backend option {sorted(query)[0]!r}")
        return cls(capacity=capacity, slot_bytes=slot, url=url, **known)

    @classmethod
    def open_read_only(cls, url: str, *, options: dict | None = None, timeout: float = 5.0) -> HostBackend:
        raise ConfigError("host:// lives inside a serving process; point tools at the disk or "
                          "remote tier (or use `tiered-kv stats` on its metrics port)")

    # -- slot interface (two-phase, leases) ----------------------------------------------------
    def can_reserve(self, n: int) -> bool:
        """Whether ``n`` slots could be had now: free, or evictable (committed, not leased)."""
        with self._lock:
            return len(self._free) + self._ready - self._leased >= n

    def reserve_many(self, keys: Sequence[bytes], lengths: Sequence[int] | None = None,
                     tenant: bytes = b"") -> list[int | None]:
        """Phase one: a slot per key of ``tenant`` (charged ``lengths``, else a whole slot), or
        None where the key is already here or there is no room (within the tenant's quota)."""
        tenant = as_tenant(tenant)
        out, gone, quota_gone = [], [], 0  # slots handed out, keys evicted (of them by a quota)

        def undo() -> None:  # the eviction hook raised after this call reserved: its caller never learns of them
            self.abort_many([k for k, slot in zip(keys, out) if slot is not None])

        with self._evicting.handing(self.on_evict, self._lock, undo) as evicted, self._lock:  # hooked, raise or not
            fast = None if lengths is not None or self._eviction.quotas else \
                reserve_free(self._entries, self._free, self._recency, keys, tenant, self.slot_bytes)
            if fast is not None:  # whole slots, all free: nothing evicted, nothing to tell
                return fast
            try:
                for i, key in enumerate(keys):
                    length = self.slot_bytes if lengths is None else lengths[i]
                    if key in self._entries or not 0 <= length <= self.slot_bytes:  # (< 0: credited its tenant)
                        slot = None
                    else:
                        slot, by_quota = self._take_slot(tenant, length, evicted, gone)
                        quota_gone += by_quota
                    if slot is not None:
                        self._entries[key] = HostEntry(slot, length, tenant)
                        self._recency.add(key, length, tenant)
                    out.append(slot)
            except BaseException:  # none of this call's reservations stays: its caller got the error
                for key in [k for k, slot in zip(keys, out) if slot is not None]:
                    self._drop(key, self._entries[key])
                out.clear()  # (nothing left for ``undo``: these keys may be another's by then)
                raise
            finally:
                self._tell("removed", gone)  # under the lock: told in the order it happened
                if gone:  # (also when it raised: they are gone all the same)
                    self._count(evictions=len(gone), quota_evictions=quota_gone)
        return out

    def commit_many(self, keys: Sequence[bytes], *, pin: bool = False) -> None:
        """Phase two: the reserved keys become visible (most recently used); with ``pin`` they
        are leased in the same step, so no other thread can evict them in between."""
        shown, touched, refs = [], [], int(pin)
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and not entry.ready:
                    entry.ready = True
                    self._leased += entry.lease(refs)
                    touched.append(key)
                    if entry.retired and entry.refs == 0:  # retired while being filled
                        self._drop(key, entry)
                    elif not entry.retired:
                        shown.append(key)
            self._ready += len(touched)
            self._recency.touch_many(touched)  # (a key dropped above is no longer there)
            self._tell("stored", shown)

    def abort_many(self, keys: Sequence[bytes]) -> None:
        """Roll back reservations that were never committed."""
        with self._lock:
            for key in keys:
                if (entry := self._entries.get(key)) is not None and not entry.ready:
                    self._drop(key, entry)

    def pin_many(self, keys: Sequence[bytes], tenant: bytes | None = None) -> list[int | None]:  # type: ignore[override]
        """Lease committed entries (then kept); their slots, or None (with ``tenant``: for another tenant's)."""
        out: list[int | None] = []
        get, leased = self._entries.get, 0
        with self._lock:
            for key in keys:
                entry = get(key)
                if entry is None or not entry.ready or entry.retired or tenant not in (None, entry.tenant):
                    out.append(None)
                    continue
                leased += entry.lease()
                out.append(entry.slot)
            self._leased += leased
            self._recency.touch_many([k for k, s in zip(keys, out) if s is not None])
        return out

    def unpin_many(self, keys: Sequence[bytes]) -> None:
        get = self._entries.get
        with self._lock:
            for key in keys:
                entry = get(key)
                if entry is not None and entry.refs > 0:
                    self._leased -= entry.release()
                    if entry.retired and entry.refs == 0:
                        self._drop(key, entry)

    def retire_many(self, keys: Sequence[bytes], *, withdrawn: bool = True) -> int:
        """Withdraw entries whose bytes may be wrong: an unleased one is dropped now; a leased one,
        or one reserved and still being filled, becomes invisible at once (no lookup, pin or read
        sees it; a commit does not publish it) and is dropped when its last lease ends; how many
        stay behind. Not ``withdrawn`` (a failed load's reservation, state "failed"): evicted
        bytes stay good."""
        left, gone = 0, []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    continue
                if entry.ready and not entry.retired:
                    gone.append(key)  # invisible from now on
                if entry.ready and entry.refs == 0:
                    self._drop(key, entry)
                else:  # leased, or reserved and being filled: withdrawn once that ends
                    entry.retired, entry.withdrawn = True, entry.withdrawn or withdrawn
                    left += 1
            self._evicting.withdraw(keys if withdrawn else ())  # (bytes evicted before, not yet hooked)
            self._tell("removed", gone)
        return left

    def slot_view(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        """A uint8 tensor over ``slot`` (the first ``nbytes`` bytes)."""
        return self.slab[slot, : self.slot_bytes if nbytes is None else nbytes]

    def reserved(self, key: bytes) -> bool:
        """Whether ``key`` is reserved (phase one) and not yet committed or aborted."""
        with self._lock:
            return (entry := self._entries.get(key)) is not None and not entry.ready

    def withdrawn_in_eviction(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key was withdrawn while its evicted bytes were on their way to ``on_evict``."""
        with self._lock:
            return self._evicting.withdrawn(keys)

    def states_many(self, keys: Sequence[bytes]) -> list[str | None]:
        """Where each key stands: None (not here), else :attr:`HostEntry.state`."""
        with self._lock:
            return [None if (e := self._entries.get(k)) is None else e.state for k in keys]

    # -- byte interface ------------------------------------------------------------------------
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return self._get_by_visiting(keys)

    def visit_many(self, keys: Sequence[bytes], visitor: Visitor) -> list[bool]:
        self._check_open()
        slots = self.pin_many(keys)
        nbytes = 0
        try:
            found = []
            for i, (key, slot) in enumerate(zip(keys, slots)):
                found.append(slot is not None)
                if slot is not None:
                    length = self._entries[key].length
                    visitor(i, memoryview(self._np[slot, :length]))
                    nbytes += length
            self._count(gets=len(keys), hits=sum(found), bytes_out=nbytes)
            return found
        finally:
            self.unpin_many([k for k, s in zip(keys, slots) if s is not None])

    def put_many(self, items: Sequence[tuple[bytes, bytes]], tenant: bytes = b"") -> list[bool]:
        self._check_open()
        if not items:
            return []
        keys = [k for k, _ in items]
        lengths = [len(memoryview(v).cast("B")) for _, v in items]
        self.delete_many([k for k, n in zip(keys, lengths) if n <= self.slot_bytes])  # overwrite
        slots = self.reserve_many(keys, lengths, tenant)
        stored = []
        for (_key, value), slot, n in zip(items, slots, lengths):
            if slot is not None:
                self._np[slot, :n] = memoryview(value).cast("B")
            stored.append(slot is not None)
        self.commit_many([k for k, s in zip(keys, slots) if s is not None])
        self._count(puts=sum(stored), put_rejected=len(stored) - sum(stored),
                    bytes_in=sum(n for n, ok in zip(lengths, stored) if ok))
        return stored

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        self._check_open()
        with self._lock:
            return [(e := self._entries.get(k)) is not None and e.ready and not e.retired for k in keys]

    def delete_many(self, keys: Sequence[bytes]) -> int:
        self._check_open()
        gone = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and entry.ready and entry.refs == 0:
                    if not entry.retired:
                        gone.append(key)
                    self._drop(key, entry)
            self._tell("removed", gone)
        self._count(deletes=len(gone))
        return len(gone)

    def scan(self, prefix: bytes = b"") -> Iterator[bytes]:
        with self._lock:
            keys = [k for k, e in self._entries.items() if e.ready and not e.retired and k.startswith(prefix)]
        return iter(keys)

    def tenant_totals(self) -> dict[bytes, TenantTotal]:
        """Per tenant: bytes (the lengths reserved) and entries, reservations included."""
        with self._lock:
            usage = self._recency.usage()
        return {tenant: TenantTotal(*t) for tenant, t in usage.items()}

    def stats(self) -> BackendStats:
        """Counts kept as entries change, read without the lock (a scrape scanned every entry
        under it, holding up the engine's calls); each is exact as of some moment."""
        return self._snapshot(entries=self._ready, used_bytes=self._recency.used(), capacity_bytes=self.capacity,
                              extra={"slots": self.num_slots, "slot_bytes": self.slot_bytes,
                                     "pinned_memory": self.pinned, "leased": self._leased})

    def close(self) -> None:
        """Forget every block and hand the slab's memory back now (views of it are dropped by
        their makers' close): a store in a reference cycle kept it until the collector ran."""
        with self._lock:
            self._closed = True
            self._entries.clear()
            self._recency = RecencyIndex(self._held)
            self._free, self._ready, self._leased = [], 0, 0
            settle_copies(self.pinned)
            self.slab = no_slab(self.slot_bytes)
            self._np = self.slab.numpy()

    # -- internals -----------------------------------------------------------------------------
    def _held(self, key: bytes) -> bool:
        """Not to be evicted: leased, or reserved and not committed yet."""
        entry = self._entries[key]
        return entry.refs > 0 or not entry.ready

    def _take_slot(self, tenant: bytes, length: int, evicted: list, gone: list) -> tuple[int | None, int]:
        """A free slot for ``length`` bytes of ``tenant`` (None when there can be none) after
        evicting what its quota, then the lack of a free slot, asks for (appended to ``gone``,
        with their bytes to ``evicted`` for the hook), and how many the quota asked for."""
        if self._free and not self._eviction.quotas:  # the common case: a free slot
            return self._free.pop(), 0
        plan = self._eviction.plan(self._recency, tenant, length) if self._eviction.quotas else Plan()
        if plan is None:
            return None, 0
        if not self._free and not plan.quota:  # no slot freed by the quota: the first to go
            victim = self._eviction.next_victim(self._recency)
            if victim is None:
                return None, 0
            plan.capacity = [victim]
        for key, _ in plan.victims:
            entry = self._entries[key]
            if self.on_evict is not None:
                evicted.append((key, bytes(self._np[entry.slot, : entry.length]), entry.tenant,
                                self._evicting.taken(key)))
            gone.append(key)
            self._drop(key, entry)
        return self._free.pop(), len(plan.quota)

    def _drop(self, key: bytes, entry: HostEntry) -> None:
        del self._entries[key]
        self._recency.remove(key)
        self._ready -= entry.ready
        self._leased -= entry.refs > 0  # (0 today: callers drop only entries without leases)
        self._free.append(entry.slot)

    def _check_open(self) -> None:
        if self._closed:
            raise BackendClosed("host backend is closed")
