"""What the host tier knows of each key it holds: its slot, the bytes charged, its tenant and
where it stands (reserved, committed, leased, withdrawn, failed); and the batch reservation of
free slots that makes them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

from storage_backends.recency import RecencyIndex


@dataclass(slots=True)  # slots: one is made per block reserved, and read on every lookup
class HostEntry:
    slot: int  # the slab row holding the bytes
    length: int  # bytes charged (to the tenant's quota and the recency index)
    tenant: bytes = b""  # who stored it
    ready: bool = False  # committed: visible to lookups and loads
    refs: int = 0  # pins (leases) held by loads in flight
    retired: bool = False  # superseded while leased: invisible, dropped when the last lease ends
    withdrawn: bool = False  # retired because its bytes may be wrong (else: a failed load's reservation)

    @property
    def state(self) -> str:
        """"reserved" (being filled), "ready" (committed), "retired" (withdrawn: held until its
        leases end, never published) or "failed" (a failed load's reservation, never withdrawn:
        held until its load is released, never published)."""
        if self.retired:
            return "retired" if self.withdrawn else "failed"
        return "ready" if self.ready else "reserved"

    def lease(self, n: int = 1) -> int:
        """Take ``n`` leases; 1 when the entry became leased by them (the tier counts its leased
        entries as they change, for figures without a scan), else 0."""
        was, self.refs = self.refs, self.refs + n
        return int(was == 0 < n)

    def release(self) -> int:
        """End one lease; 1 when it was the last (the entry is no longer leased), else 0."""
        self.refs -= 1
        return int(self.refs == 0)


def reserve_free(entries: dict[bytes, HostEntry], free: list[int], recency: RecencyIndex,
                 keys: Sequence[bytes], tenant: bytes, slot_bytes: int) -> list[int | None] | None:
    """The host tier's reservation of whole slots from its ``free`` ones (popped from the end)
    in one batch, under its lock; None (nothing taken) if too few."""
    new = [k for k in dict.fromkeys(keys) if k not in entries]
    if len(new) > len(free):
        return None
    taken = free[len(free) - len(new):][::-1]  # the order pop() hands them out
    del free[len(free) - len(new):]
    entries.update(zip(new, map(HostEntry, taken, repeat(slot_bytes), repeat(tenant))))
    recency.add_new(new, slot_bytes, tenant)
    if len(new) == len(keys):  # every key new, none twice: ``new`` is ``keys``
        return taken
    return list(map(dict(zip(new, taken)).pop, keys, repeat(None)))  # a key twice: one slot
