"""What a put must evict: the one place that decides victims, for every medium that evicts.

A medium describes what it holds through an :class:`EvictionIndex` (entries from the first to go,
overall and per tenant; whether one is pinned; bytes used overall and per tenant) and asks
:class:`Eviction` for a :class:`Plan` before storing a value; a :class:`Policy` orders the
candidates (least recently used today: :mod:`storage_backends.eviction_lru`).

The rule for a put of ``size`` bytes for tenant T:

1. a value larger than the capacity or than T's quota is refused;
2. if T would go over its quota, T's own unpinned entries go, first to go first, never another
   tenant's; when they cannot make room the put is refused and nothing is evicted (T's other
   data is not lost to a put that fails anyway);
3. then the overall capacity is kept by the policy over everyone's unpinned entries (again
   all or nothing).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from storage_backends.quotas import NO_QUOTAS, Quotas

Victim = tuple[bytes, int]  # (key, bytes it frees)


class EvictionIndex(Protocol):
    """What a medium holds, as eviction needs to see it."""

    def oldest(self, tenant: bytes | None = None) -> Iterable[Victim]:
        """(key, size) of every entry (of ``tenant`` only, when given), least recently used first."""

    def pinned(self, key: bytes) -> bool:
        """Whether ``key`` must stay (leased, or being written)."""

    def used(self, tenant: bytes | None = None) -> int:
        """Bytes held (by ``tenant`` only, when given)."""


class Policy(Protocol):
    """The order in which entries go."""

    name: str

    def candidates(self, index: EvictionIndex, tenant: bytes | None = None) -> Iterator[Victim]:
        """Unpinned entries (of ``tenant`` only, when given), the first to go first."""


@dataclass
class Plan:
    """Victims of one put: the tenant's own for its quota, then anyone's for the capacity."""

    quota: list[Victim] = field(default_factory=list)
    capacity: list[Victim] = field(default_factory=list)

    @property
    def victims(self) -> list[Victim]:
        return self.quota + self.capacity


class Eviction:
    """Decides victims for one medium: its byte ``capacity`` (None: unbounded, or bounded in
    another unit the medium keeps itself, as the host's slots), its tenant ``quotas`` and the
    ``policy`` that orders candidates."""

    def __init__(self, policy: Policy, capacity: int | None = None, quotas: Quotas = NO_QUOTAS) -> None:
        self.policy, self.capacity, self.quotas = policy, capacity, quotas

    def fits(self, tenant: bytes, size: int) -> bool:
        """Whether a value of ``size`` bytes could ever be stored for ``tenant``."""
        quota = self.quotas.of(tenant)
        return (self.capacity is None or size <= self.capacity) and (quota is None or size <= quota)

    def plan(self, index: EvictionIndex, tenant: bytes, size: int) -> Plan | None:
        """The entries to evict before storing ``size`` bytes for ``tenant``; None: refuse the
        put (evict nothing)."""
        if not self.fits(tenant, size):
            return None
        plan = Plan()
        quota = self.quotas.of(tenant)
        if quota is not None:
            over = index.used(tenant) + size - quota
            if over > 0:
                plan.quota = take(self.policy.candidates(index, tenant), over)
                if plan.quota is None:
                    return None
        if self.capacity is not None:
            over = index.used() - sum(n for _, n in plan.quota) + size - self.capacity
            if over > 0:
                chosen = {k for k, _ in plan.quota}
                plan.capacity = take((v for v in self.policy.candidates(index) if v[0] not in chosen), over)
                if plan.capacity is None:
                    return None
        return plan

    def beyond_capacity(self, index: EvictionIndex, nbytes: int) -> list[Victim]:
        """As many entries as it takes (or as there are) to hold ``nbytes`` more than the
        capacity allows (a medium whose own space ran out before its capacity); none without a
        capacity (there is nothing to be beyond: measured against 0, everything would go)."""
        if self.capacity is None:
            return []
        over = index.used() + nbytes - self.capacity
        chosen: list[Victim] = []
        for victim in self.policy.candidates(index) if over > 0 else ():
            chosen.append(victim)
            over -= victim[1]
            if over <= 0:
                break
        return chosen

    def next_victim(self, index: EvictionIndex) -> Victim | None:
        """The one entry to go first (a medium short of a slot rather than of bytes)."""
        return next(self.policy.candidates(index), None)


def take(candidates: Iterable[Victim], nbytes: int) -> list[Victim] | None:
    """The first ``candidates`` that free at least ``nbytes``; None when all of them do not."""
    chosen, freed = [], 0
    for victim in candidates:
        chosen.append(victim)
        freed += victim[1]
        if freed >= nbytes:
            return chosen
    return None
