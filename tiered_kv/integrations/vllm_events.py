"""The store's block events in vLLM's own KV-event form (``--kv-events-config``), so a router
that consumes vLLM's KV events (llm-d, Dynamo-style) learns which tier of which replica holds
a prefix. No torch here: the scheduler half uses it.

The path through vLLM 0.32 (on only when ``kv_events_config.enable_kv_cache_events``):

1. each worker subscribes to its store's events (:mod:`tiered_kv.store.block_events`);
   ``get_kv_connector_kv_cache_events()`` hands vLLM that step's events as a
   :class:`TieredKVEvents` (a ``KVConnectorKVEvents``; vLLM's ``KVOutputAggregator`` combines
   the workers' into one in ``KVConnectorOutput.kv_cache_events``);
2. the scheduler half's ``update_connector_output()`` passes it to :class:`VllmEventTracker`,
   which turns it into ``BlockStored`` / ``BlockRemoved`` (``medium``: our tier name, ``host``,
   ``disk``, ``remote``...; vLLM's own ``GPU``, ``CPU`` and ``STORAGE`` are no tier's name); a
   block is announced stored once every tensor-parallel rank stored its shard in that tier (and
   again when they do again), removed as soon as one rank dropped it, under the hash its
   ``BlockStored`` carried (:mod:`tiered_kv.integrations.vllm_holdings`);
3. ``take_events()`` hands them to vLLM's scheduler, which publishes them with its own.

Block identity: the store keys blocks by our chained content keys, routers by vLLM's block
hashes. When the scheduler half plans a save or a load it remembers, per key, the request's
vLLM block hash (``request.block_hashes``, at vLLM's block size, converted as vLLM converts
its own: ``maybe_convert_block_hash``), the parent's, the block's token ids and the LoRA
adapter; events carry those, so they name the same blocks as vLLM's GPU events do. Where vLLM
has no hash for a block (its hash block size differs from the block size) the event carries
our keys instead, chained the same way, with the token ids (routers hashing tokens still
match). Keys this scheduler never planned (a bounded memory of ``REMEMBERED`` keys forgot
them, or another process stored them) are stored in vLLM's placeholder form: the key as the
hash, no tokens, ``block_size`` 0. A removal names the block as its ``BlockStored`` did, kept
per tier while the tier holds it (forgetting planned names does not rename it).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from tiered_kv.errors import ConfigError
from tiered_kv.integrations.vllm_holdings import Holdings
from tiered_kv.store.block_events import LOST, REMOVED, STORED, BlockEvent

log = logging.getLogger(__name__)

REMEMBERED = 1 << 17  # keys whose planned vLLM names are remembered (least recently planned forgotten)
QUEUED = 1 << 16  # vLLM events waiting for take_events (oldest dropped beyond, counted)

try:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVConnectorKVEvents
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
except ImportError:  # no vLLM: the same fields in plain frozen dataclasses (tests, tools)

    @dataclass(frozen=True)
    class BlockStored:  # type: ignore[no-redef]
        block_hashes: list
        parent_block_hash: Any
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None = None

    @dataclass(frozen=True)
    class BlockRemoved:  # type: ignore[no-redef]
        block_hashes: list
        medium: str | None

    @dataclass(frozen=True)
    class AllBlocksCleared:  # type: ignore[no-redef]
        pass

    class KVConnectorKVEvents:  # type: ignore[no-redef]
        pass

    def maybe_convert_block_hash(hash_bytes: bytes) -> Any:  # type: ignore[misc]
        return hash_bytes


# vLLM's own KV-event media (vllm.distributed.kv_events: MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE)
VLLM_MEDIA = ("GPU", "CPU", "STORAGE")


def check_media(config) -> None:
    """With vLLM's KV events on, a tier's name is its events' ``medium``: none may be one of
    vLLM's own (any case), or a router would take our blocks for vLLM's GPU prefix cache's."""
    for tier in config.lower_tiers:
        if tier.name.upper() in VLLM_MEDIA:
            raise ConfigError(f"{tier.SECTION}.name must not be {tier.name!r} with vLLM's KV events on: vLLM "
                              f"names its own caches {', '.join(VLLM_MEDIA)} (any case), and a tier's name is "
                              f"its events' medium")


class TieredKVEvents(KVConnectorKVEvents):
    """One step's block events of the workers, on their way to the scheduler half: our neutral
    :class:`BlockEvent` batches, each worker's under its tensor-parallel rank."""

    def __init__(self, events: list[tuple[int, BlockEvent]] | None = None, num_workers: int = 1) -> None:
        self.events = list(events or ())
        self.num_workers = num_workers

    def add_events(self, events: list) -> None:
        self.events.extend(events)

    def aggregate(self) -> TieredKVEvents:
        return self  # the tracker counts ranks per block itself

    def increment_workers(self, count: int = 1) -> None:
        self.num_workers += count

    def get_all_events(self) -> list:
        return list(self.events)

    def get_number_of_workers(self) -> int:
        return self.num_workers

    def clear_events(self) -> None:
        self.events.clear()


def worker_events(feed: Any, rank: int) -> TieredKVEvents | None:
    """The events ``feed`` collected since the last step, as vLLM carries them (None: none);
    a removal of another rank's copies (``BlockEvent.rank``) goes under that rank."""
    events = feed.take()
    return TieredKVEvents([(rank if e.rank is None else e.rank, e) for e in events]) if events else None


@dataclass(frozen=True)
class BlockName:
    """What a vLLM event says of one block."""

    block_hash: Any
    parent: Any  # the previous block's hash; None for a prompt's first block
    token_ids: tuple[int, ...]
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass
class VllmEventTracker:
    """Scheduler half: remembers the vLLM names of planned blocks and turns the workers' block
    events into vLLM's ``BlockStored`` / ``BlockRemoved``."""

    block_size: int
    ranks: int = 1  # tensor-parallel ranks that each store a shard of every block
    names: OrderedDict = field(default_factory=OrderedDict)  # key -> BlockName, as planned
    held: Holdings = field(init=False)  # per tier: ranks holding each block, the hash announced
    queued: list = field(default_factory=list)
    crowded: set = field(default_factory=set)  # tiers that outgrew vllm_holdings.HELD (warned once)
    dropped: int = 0  # vLLM events dropped because nobody took them

    def __post_init__(self) -> None:
        self.held = Holdings(self.ranks)

    def remember(self, request: Any, keys: list[bytes] | tuple[bytes, ...], first_block: int,
                 chain: list[bytes]) -> None:
        """Blocks ``first_block``... of ``request`` are planned under ``keys`` (``chain``: all the
        request's keys, for the parent of the first)."""
        tokens = list(getattr(request, "all_token_ids", None) or request.prompt_token_ids)
        hashes = list(getattr(request, "block_hashes", None) or ())
        bs = self.block_size
        vllm = len(hashes) == len(tokens) // bs  # vLLM hashes at our block size
        lora = getattr(request, "lora_request", None)
        lora_id = getattr(lora, "lora_int_id", None) if lora is not None else None
        lora_name = getattr(lora, "lora_name", None) if lora is not None else None
        for i, key in enumerate(keys):
            pos = first_block + i
            if vllm:
                mine, parent = hashes[pos], hashes[pos - 1] if pos else None
            else:
                mine, parent = key, chain[pos - 1] if pos and pos - 1 < len(chain) else None
            self.names[key] = BlockName(maybe_convert_block_hash(mine),
                                        None if parent is None else maybe_convert_block_hash(parent),
                                        tuple(tokens[pos * bs:(pos + 1) * bs]), lora_id, lora_name)
            self.names.move_to_end(key)
        while len(self.names) > REMEMBERED:
            self.names.popitem(last=False)

    def receive(self, container: Any) -> None:
        """A step's :class:`TieredKVEvents` from the workers (anything else is not ours)."""
        if not isinstance(container, TieredKVEvents):
            return
        for rank, event in container.get_all_events():
            if event.kind == LOST:  # the rank's feed dropped events of the tier: it may hold none
                hashes = self.held.lost(event.tier, rank)
                if hashes:
                    self._queue([BlockRemoved(block_hashes=hashes, medium=event.tier)])
                continue
            if event.kind == REMOVED:
                hashes = self.held.removed(event.tier, rank, event.keys, lambda k: self._name(k).block_hash)
                if hashes:
                    self._queue([BlockRemoved(block_hashes=hashes, medium=event.tier)])
                continue
            assert event.kind == STORED
            names = self.held.stored(event.tier, rank, event.keys, self._name)
            forgotten = self.held.trim(event.tier)
            self._queue(list(self._stored(event.tier, names)))
            if forgotten:  # retracted while their hashes are known (vllm_holdings: bounded)
                log.log(logging.DEBUG if event.tier in self.crowded else logging.WARNING,
                        "tiered-kv: tier %s holds more blocks than the %d KV events keep track of: "
                        "%d least recently stored announced removed", event.tier,
                        len(self.held.tiers[event.tier]), len(forgotten))
                self.crowded.add(event.tier)
                self._queue([BlockRemoved(block_hashes=forgotten, medium=event.tier)])

    def take(self) -> list:
        out, self.queued = self.queued, []
        return out

    def _name(self, key: bytes) -> BlockName:
        """``key``'s vLLM name as planned, else vLLM's placeholder form (the key as the hash)."""
        return self.names.get(key) or BlockName(maybe_convert_block_hash(key), None, ())

    def _stored(self, tier: str, names: list[BlockName]):
        """One BlockStored per run of chained blocks."""
        start = 0
        for i in range(1, len(names) + 1):
            if i < len(names) and names[i].token_ids and names[i - 1].token_ids \
                    and names[i].parent == names[i - 1].block_hash \
                    and (names[i].lora_id, names[i].lora_name) == (names[i - 1].lora_id, names[i - 1].lora_name):
                continue
            run = names[start:i]
            yield BlockStored(block_hashes=[n.block_hash for n in run], parent_block_hash=run[0].parent,
                              token_ids=[t for n in run for t in n.token_ids],
                              block_size=self.block_size if run[0].token_ids else 0,
                              lora_id=run[0].lora_id, medium=tier, lora_name=run[0].lora_name)
            start = i

    def _queue(self, events: list) -> None:
        self.queued.extend(events)
        if len(self.queued) > QUEUED:
            # dropping some could drop a BlockRemoved and leave its blocks announced for ever:
            # all go, the router is told to forget this replica's blocks (vLLM's own included,
            # as after a prefix-cache reset), and ours are announced again as they are stored
            self.dropped += len(self.queued)
            log.warning("tiered-kv: %d KV events dropped (nobody took them); all blocks announced "
                        "cleared", len(self.queued))
            self.queued = [AllBlocksCleared()]
            self.held.unannounce()
