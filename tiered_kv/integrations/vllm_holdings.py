"""What the scheduler half knows of each tier's blocks, for vLLM's KV events
(:mod:`tiered_kv.integrations.vllm_events`): per tier and key, which tensor-parallel ranks hold
their shard there, and the block hash the tier's ``BlockStored`` named it by. No torch here.

- **Stored**: a block is announced once ``ranks`` ranks hold their shard in the tier (once per
  holding: a rank storing a shard again while the block is announced adds nothing), and again
  when they do again after a removal: a rank that dropped its shard and stores it anew completes
  the block once more, the other ranks having kept theirs.
- **Removed**: as soon as one rank drops its shard the block is announced removed, under the hash
  its ``BlockStored`` carried, whatever the scheduler planned or forgot since; a shard dropped
  while the block is not announced says nothing more. A removal of a block this process never
  saw stored in that tier (stored before it started, or forgotten, below) is named as the
  scheduler would name it now. A record goes with its last rank's removal.
- **Bounded**: per tier the ``HELD`` (1,048,576) most recently stored blocks are known, about
  250 bytes each: at most ~250 MiB per tier, reached only by a tier holding that many blocks.
  Past that the least recently stored block is forgotten, and when it was announced it is
  announced removed then: a router may miss a block the tier still holds, never keep one nobody
  can retract. Tiers whose medium evicts unseen (Redis ``maxmemory``, TTLs) reach the bound and
  shed their oldest blocks so.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

HELD = 1 << 20  # blocks known per tier (least recently stored forgotten, announced removed)


class _Held:
    """One block in one tier."""

    __slots__ = ("ranks", "told")

    def __init__(self) -> None:
        self.ranks = 0  # bit r: rank r holds its shard
        self.told: Any = None  # the hash its BlockStored carried; None: not announced now


class Holdings:
    """Per tier and key: the ranks holding a shard, and the hash the block was announced under."""

    def __init__(self, ranks: int = 1) -> None:
        self.ranks = ranks
        self.tiers: dict[str, OrderedDict[bytes, _Held]] = {}  # tier -> key -> holding, least recently stored first

    def stored(self, tier: str, rank: int, keys: Iterable[bytes], name_of: Callable[[bytes], Any]) -> list:
        """Rank ``rank`` stored ``keys`` in ``tier``: the names (``name_of(key)``, whose
        ``block_hash`` is remembered) of the blocks to announce stored now, in order."""
        held = self.tiers.setdefault(tier, OrderedDict())
        out = []
        for key in keys:
            holding = held.get(key)
            if holding is None:
                holding = held[key] = _Held()
            else:
                held.move_to_end(key)  # most recently stored last
            holding.ranks |= 1 << rank
            if holding.told is None and holding.ranks.bit_count() >= self.ranks:
                name = name_of(key)
                holding.told = name.block_hash
                out.append(name)
        return out

    def removed(self, tier: str, rank: int, keys: Iterable[bytes], hash_of: Callable[[bytes], Any]) -> list:
        """Rank ``rank`` dropped ``keys`` from ``tier``: the hashes to announce removed."""
        held = self.tiers.get(tier) or OrderedDict()
        bit = 1 << rank
        out = []
        for key in keys:
            holding = held.get(key)
            if holding is None or (holding.told is None and not holding.ranks & bit):
                out.append(hash_of(key))  # never seen stored here: named as it would be now
                continue
            _drop(held, key, holding, bit, out)
        return out

    def trim(self, tier: str) -> list:
        """Forget ``tier``'s least recently stored blocks beyond ``HELD``: the hashes of those
        that were announced (to announce removed)."""
        held = self.tiers.get(tier) or OrderedDict()
        out = []
        while len(held) > HELD:
            _, holding = held.popitem(last=False)
            if holding.told is not None:
                out.append(holding.told)
        return out

    def lost(self, tier: str, rank: int) -> list:
        """Rank ``rank``'s events of ``tier`` were dropped (it may have dropped any shard): the
        hashes of the blocks announced there, to announce removed; its shards are forgotten (a
        block it stores again is announced again once the other ranks hold theirs)."""
        held = self.tiers.get(tier) or OrderedDict()
        bit = 1 << rank
        out = []
        for key, holding in list(held.items()):
            _drop(held, key, holding, bit, out)
        return out

    def unannounce(self) -> None:
        """Every block counts as not announced (the router was told to forget them all); the
        shards held stay known, so a block stored again is announced again."""
        for held in self.tiers.values():
            for holding in held.values():
                holding.told = None

    def __len__(self) -> int:
        return sum(len(held) for held in self.tiers.values())


def _drop(held: OrderedDict, key: bytes, holding: _Held, bit: int, out: list) -> None:
    """The shard of rank ``bit`` of ``key`` dropped: its announced hash (once) goes to ``out``,
    the record with its last rank."""
    if holding.told is not None:
        out.append(holding.told)
        holding.told = None
    holding.ranks &= ~bit
    if not holding.ranks:
        del held[key]
