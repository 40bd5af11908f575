"""An in-memory :class:`~storage_backends.eviction.EvictionIndex`: entries in access order,
overall and per tenant, with the bytes each tenant holds (the host slab's entries, the file
medium's view of its directory)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from itertools import islice, repeat

from storage_backends.eviction import Victim


class RecencyIndex:
    """Keys with their size and tenant, least recently used first. ``pinned(key)`` says which
    ones must stay (the medium knows its leases)."""

    def __init__(self, pinned: Callable[[bytes], bool]) -> None:
        self._pinned = pinned
        self._all: OrderedDict[bytes, tuple[int, bytes]] = OrderedDict()  # key -> (size, tenant)
        self._tenants: dict[bytes, OrderedDict[bytes, int]] = {}  # tenant -> key -> size
        self._used: dict[bytes, int] = {}  # tenant -> bytes
        self._total = 0

    def add(self, key: bytes, size: int, tenant: bytes = b"") -> None:
        """``key`` as the most recently used entry (replacing what it was)."""
        self.remove(key)
        self.add_new((key,), size, tenant)

    def add_new(self, keys: Sequence[bytes], size: int, tenant: bytes = b"") -> None:
        """``keys`` (none of them here, no duplicates) as the most recently used entries, in
        their order, ``size`` bytes each: one batch for a reservation of many blocks."""
        self._all.update(zip(keys, repeat((size, tenant))))
        self._tenants.setdefault(tenant, OrderedDict()).update(zip(keys, repeat(size)))
        self._used[tenant] = self._used.get(tenant, 0) + size * len(keys)
        self._total += size * len(keys)

    def touch(self, key: bytes) -> None:
        """``key`` (if here) becomes the most recently used."""
        self.touch_many((key,))

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """:meth:`touch` of each of ``keys``, in their order (one call for a batch). Nothing to
        do when they are the newest entries already, in that order (a batch committed right
        after it was reserved): the tenants' orders follow the overall one, so they are the
        newest of their tenants too. Asked of the overall order in one pass (~25 ns a key,
        against two moves of ~60 ns)."""
        everyone, tenants = self._all, self._tenants
        if list(islice(reversed(everyone), len(keys))) == list(reversed(keys)):
            return
        for key in keys:
            found = everyone.get(key)
            if found is not None:
                everyone.move_to_end(key)
                tenants[found[1]].move_to_end(key)

    def remove(self, key: bytes) -> tuple[int, bytes] | None:
        """Forget ``key``; its (size, tenant), or None when it was not here."""
        found = self._all.pop(key, None)
        if found is not None:
            size, tenant = found
            mine = self._tenants[tenant]
            del mine[key]
            self._used[tenant] -= size
            self._total -= size
            if not mine:
                del self._tenants[tenant], self._used[tenant]
        return found

    def oldest(self, tenant: bytes | None = None) -> Iterator[Victim]:
        if tenant is None:
            return ((key, size) for key, (size, _) in self._all.items())
        return iter(self._tenants.get(tenant, {}).items())

    def pinned(self, key: bytes) -> bool:
        return self._pinned(key)

    def used(self, tenant: bytes | None = None) -> int:
        return self._total if tenant is None else self._used.get(tenant, 0)

    def usage(self) -> dict[bytes, tuple[int, int]]:
        """tenant -> (bytes, entries) of every tenant holding something."""
        return {tenant: (self._used[tenant], len(keys)) for tenant, keys in self._tenants.items()}
