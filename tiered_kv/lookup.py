"""A lookup-only block index over the disk and remote tiers, for a scheduler in another process.

Engines such as vLLM run the scheduler half of a connector in a process that holds no KV: the
worker processes own the device pool and the store's host tier. :class:`LowerTierIndex` gives
that scheduler what it needs of the store — :meth:`lookup` — over the tiers every process can
see (LMDB on a shared disk, Redis), without a host slab and without torch. Leases are not taken
here: the worker's :meth:`TieredStore.take_lease` falls back to a fresh ``prepare_load``, and a
block evicted in between is a counted load failure that the engine recomputes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from storage_backends.registry import open_backend
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import BackendUnavailable
from tiered_kv.keys import Namespace

log = logging.getLogger(__name__)


class LowerTierIndex:
    """``lookup`` over the disk and remote tiers of ``config``; ``lease`` is a no-op."""

    def __init__(self, config: TieredKVConfig, namespace: Namespace) -> None:
        self.namespace = namespace
        self._prefix = namespace.digest()  # stored keys are namespace digest || block key
        self.tiers = []
        if config.disk.url:
            self.tiers.append(("disk", open_backend(config.disk.url, capacity=config.disk.capacity,
                                                    sync=config.disk.sync)))
        if config.remote.url:
            self.tiers.append(("remote", open_backend(
                config.remote.url, ttl=config.remote.ttl, timeout=config.remote.timeout,
                retries=config.remote.retries)))
        self.unavailable = 0  # lookups that found a tier down
        if not self.tiers:
            log.warning("tiered-kv: the scheduler runs apart from the workers and no disk or remote "
                        "tier is configured: it sees no stored block, so nothing will be loaded")

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the disk or remote tier holds. Side-effect free."""
        if not keys:
            return 0
        present = [False] * len(keys)
        for name, backend in self.tiers:
            todo = [i for i, p in enumerate(present) if not p]
            if not todo:
                break
            try:
                found = backend.contains_many([self._prefix + keys[i] for i in todo])
            except BackendUnavailable:
                self.unavailable += 1
                log.debug("tiered-kv lookup: %s tier unavailable", name)
                continue
            for i, hit in zip(todo, found):
                present[i] = bool(hit)
        n = 0
        while n < len(present) and present[n]:
            n += 1
        return n

    def lease(self, lease_id: str, keys: Sequence[bytes]) -> None:
        """Nothing to pin from here: the worker leases the blocks when it loads them."""

    def drop_lease(self, lease_id: str) -> None:
        """See :meth:`lease`."""

    def close(self) -> None:
        for _, backend in self.tiers:
            backend.close()
        self.tiers = []
