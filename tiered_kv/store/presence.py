"""Which blocks the lower tiers hold for *every* tensor-parallel rank (no torch here).

With tensor parallelism each rank stores its own shard of a block, under its own namespace
(``namespace(tp_rank=r) digest || key``); the chained keys are the same on every rank (the
scheduler computes them once). The scheduler runs beside one rank, or none, and its promise
binds all ranks: a block counts as present only when every rank's copy is held by some tier.
A rank whose copy is missing (a dropped save, a failed write, a removed corrupt copy, LRU that
took one rank's copy first) would otherwise turn every hit into a wasted load. An engine whose
ranks agree among themselves (SGLang's HiCache) asks for its own rank's copies only
(``locate(..., own_only=True)``).

Each tier is asked behind a :class:`~tiered_kv.store.lookup_deadline.DeadlineLookup`: a tier that does
not answer in time, or is down, counts as a miss (``lookup_timeout``, ``<tier>_unavailable``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

from tiered_kv.errors import BackendUnavailable
from tiered_kv.keys import Namespace, leading_present
from tiered_kv.store.lookup_deadline import DeadlineLookup, LookupTimedOut

log = logging.getLogger(__name__)

KEYS_PER_PART = 256  # storage keys per presence query: an answer cut by the deadline keeps whole parts
MissCounter = Callable[[str, str, int], None]  # (tier, reason, blocks)


def rank_prefixes(namespace: Namespace) -> list[bytes]:
    """The storage-key prefix of every rank's copies, by rank."""
    return [replace(namespace, tp_rank=r).digest() for r in range(namespace.tp_size)]


class RankedPresence:
    """Presence of blocks over ordered lower tiers, for all ranks, within a deadline per tier."""

    def __init__(self, namespace: Namespace, tiers: Sequence[tuple[str, object]], deadline: float,
                 count_miss: MissCounter | None = None) -> None:
        self.prefixes = rank_prefixes(namespace)
        self.own_rank = namespace.tp_rank
        self.tiers = list(tiers)  # (name, backend with contains_many)
        self.gates = {name: DeadlineLookup(name, deadline) for name, _ in self.tiers}
        self._count_miss = count_miss or (lambda tier, reason, n: None)

    def locate(self, keys: Sequence[bytes], own_present: Sequence[bool] | None = None, *,
               own_only: bool = False) -> tuple[list[str | None], list[bool]]:
        """(tier holding this rank's copy of each key, or "host" where ``own_present`` says so;
        whether every rank's copy of each key is held somewhere). ``own_only``: ask the lower
        tiers for this rank's copies only, for an engine that agrees across its ranks itself
        (SGLang takes the smallest answer of its ranks): ``tp_size`` times fewer keys."""
        n = len(keys)
        ranks = [self.own_rank] if own_only else range(len(self.prefixes))
        have = {r: [False] * n for r in ranks}
        where: list[str | None] = [None] * n
        for i, present in enumerate(own_present or ()):
            if present:
                have[self.own_rank][i], where[i] = True, "host"
        for name, backend in self.tiers:
            pairs = [(r, i) for i in range(n) for r in ranks if not have[r][i]]
            if not pairs:
                break
            found = self._ask(name, backend, [self.prefixes[r] + keys[i] for r, i in pairs],
                              len({i for _, i in pairs}))
            for (r, i), hit in zip(pairs, found):
                if hit:
                    have[r][i] = True
                    if r == self.own_rank and where[i] is None:
                        where[i] = name
        return where, [all(have[r][i] for r in ranks) for i in range(n)]

    def lookup(self, keys: Sequence[bytes], own_present: Sequence[bool] | None = None) -> int:
        """How many leading ``keys`` every rank can load."""
        return leading_present(self.locate(keys, own_present)[1])

    def _ask(self, name: str, backend, storage_keys: list[bytes], blocks: int) -> list[bool]:
        """Presence of ``storage_keys`` (leading keys first) in one tier; what it did not answer
        within the deadline counts as absent (``lookup_timeout``, in blocks)."""
        parts = [lambda lo=lo: list(backend.contains_many(storage_keys[lo : lo + KEYS_PER_PART]))
                 for lo in range(0, len(storage_keys), KEYS_PER_PART)]
        try:
            found, complete = self.gates[name].call_parts(parts)
            unanswered = len(storage_keys) - len(found)
            if not complete:  # in blocks (a block has a key per rank)
                self._count_miss(name, "lookup_timeout", max(1, blocks * unanswered // len(storage_keys)))
            return found + [False] * unanswered
        except LookupTimedOut:
            self._count_miss(name, "lookup_timeout", blocks)
        except BackendUnavailable:
            self._count_miss(name, f"{name}_unavailable", blocks)
            log.debug("tiered-kv lookup: %s tier unavailable", name)
        except Exception as exc:  # a lookup must never raise into the scheduler
            self._count_miss(name, f"{name}_unavailable", blocks)
            log.warning("tiered-kv lookup: %s tier failed: %r", name, exc)
        return [False] * len(storage_keys)

    def close(self) -> None:
        for gate in self.gates.values():
            gate.close()
