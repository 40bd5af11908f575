"""What the scheduler half asks of the store (a TieredStore, or a lookup-only index of the lower
tiers): how many leading keys some tier holds, leases on matched blocks, and, where the index can
say, which keys it holds and in which tier. No torch here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class BlockIndex(Protocol):
    """What the scheduler half needs of the store."""

    def lookup(self, keys: Sequence[bytes]) -> int: ...

    def lease(self, lease_id: str, keys: Sequence[bytes], tenant: bytes | None = None) -> Any: ...

    def drop_lease(self, lease_id: str) -> None: ...


def locate(index, keys: Sequence[bytes]) -> list[str | None]:
    """The tier holding each of ``keys`` (None everywhere where the index cannot say)."""
    where = getattr(index, "locate", None)
    return list(where(keys)) if where is not None and keys else [None] * len(keys)


def present(index, keys: Sequence[bytes]) -> list[bool]:
    """Which ``keys`` the index holds (one batched query where the index has one)."""
    if hasattr(index, "present"):
        return list(index.present(keys))
    return [index.lookup([k]) == 1 for k in keys]
