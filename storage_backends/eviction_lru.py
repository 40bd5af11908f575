"""The least-recently-used policy: unpinned entries go in the order the medium's index keeps
them, oldest access first."""

from __future__ import annotations

from collections.abc import Iterator

from storage_backends.eviction import EvictionIndex, Victim


class LeastRecentlyUsed:
    name = "lru"

    def candidates(self, index: EvictionIndex, tenant: bytes | None = None) -> Iterator[Victim]:
        return ((key, size) for key, size in index.oldest(tenant) if not index.pinned(key))


LRU = LeastRecentlyUsed()
