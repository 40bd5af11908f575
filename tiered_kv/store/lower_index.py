"""A lookup-only block index over the lower tiers (disk, remote, ...), for a scheduler in another process.

Engines such as vLLM run the scheduler half of a connector in a process that holds no KV: the
worker processes own the device pool and the store's host tier. :class:`LowerTierIndex` gives
that scheduler what it needs of the store — :meth:`lookup` — over the tiers every process can
see (LMDB on a shared disk, Redis), without a host slab and without torch. Leases are not taken
here: the worker's :meth:`TieredStore.take_lease` falls back to a fresh ``prepare_load``, and a
block evicted in between is a counted load failure that the engine recomputes.

The restore policy needs cost estimates, which only the workers can observe: ``costs`` is read
from the namespace record, where the workers' stores write them, when the index opens and every
``COSTS_REFRESH_S`` seconds after (:class:`~tiered_kv.store.cost_records.CostsKeeper`); what the policy
left unloaded is counted in ``skipped`` (blocks per tier) and ``skipped_tokens``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from tiered_kv.config import TieredKVConfig
from tiered_kv.keys import Namespace
from tiered_kv.store.cost_records import COSTS_REFRESH_S, CostsKeeper
from tiered_kv.store.lower_tiers import open_media
from tiered_kv.store.presence import RankedPresence
from tiered_kv.store.restore_costs import RestoreCosts

log = logging.getLogger(__name__)


class LowerTierIndex:
    """``lookup`` over the lower tiers of ``config``; ``lease`` is a no-op.

    A block counts as present only when every tensor-parallel rank's copy is held, and each
    tier answers within ``config.lookup_timeout`` or counts as a miss (:mod:`tiered_kv.store.presence`)."""

    def __init__(self, config: TieredKVConfig, namespace: Namespace) -> None:
        self.config = config
        self.namespace = namespace
        self.misses: Counter[str] = Counter()  # reason -> blocks the lookups counted as missing
        self.skipped: Counter[str] = Counter()  # tier -> blocks the restore policy did not load
        self.skipped_tokens = 0  # tokens it did not load
        self.probes = 0  # loads it made although predicted slower (to refresh the estimates)
        self.lookups_after_close = 0  # keys asked for once closed (answered: nowhere)
        self._closed = False
        self.tiers = [(tier.name, backend) for tier, backend in open_media(config)]
        self.presence = RankedPresence(namespace, self.tiers, config.lookup_timeout, self._count)
        self.costs = RestoreCosts(config.restore_min_samples)
        self.cost_record = CostsKeeper(self.costs, namespace, self.tiers, writes=False,
                                       every=COSTS_REFRESH_S)
        if not self.tiers:
            log.warning("tiered-kv: the scheduler runs apart from the workers and no lower tier "
                        "is configured: it sees no stored block, so nothing will be loaded")

    @property
    def unavailable(self) -> int:
        """Blocks that lookups counted as missing because a tier was down or did not answer."""
        return sum(self.misses.values())

    def _count(self, tier: str, reason: str, blocks: int) -> None:
        self.misses[reason] += blocks

    def _after_close(self, keys: Sequence[bytes]) -> bool:
        """Whether the index is closed: its media are, and a scheduler still stepping as its
        engine shuts down is told nothing is stored (its gates used to refuse the keys as
        ``lookup_timeout`` misses: tiers that had not timed out at all)."""
        if self._closed:
            self.lookups_after_close += len(keys)
        return self._closed

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` every rank can load from a lower tier."""
        if not keys or self._after_close(keys):
            return 0
        return self.presence.lookup(keys)

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether every rank can load each of ``keys`` from a lower tier (not a leading run)."""
        if not keys or self._after_close(keys):
            return [False] * len(keys)
        return self.presence.locate(keys)[1]

    def locate(self, keys: Sequence[bytes]) -> list[str | None]:
        """The first lower tier holding this rank's copy of each key (None: nowhere)."""
        if not keys or self._after_close(keys):
            return [None] * len(keys)
        return self.presence.locate(keys)[0]

    def count_restore_skips(self, blocks: dict[str, int], tokens: int, probe: bool = False) -> None:
        """The restore policy left ``blocks`` (per tier) and ``tokens`` unloaded, or probed."""
        self.skipped.update(blocks)
        self.skipped_tokens += tokens
        self.probes += int(probe)

    def lease(self, lease_id: str, keys: Sequence[bytes], tenant: bytes | None = None) -> None:
        """Nothing to pin from here: the worker leases the blocks when it loads them."""

    def drop_lease(self, lease_id: str) -> None:
        """See :meth:`lease`."""

    def close(self) -> None:
        self._closed = True
        self.cost_record.close()
        self.presence.close()
        for _, backend in self.tiers:
            backend.close()
        self.tiers = []
