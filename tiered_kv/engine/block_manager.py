"""Device block bookkeeping: a free list, reference counts and prefix reuse by chained keys.

A full, computed block is published under its chained key (:mod:`tiered_kv.keys`); a later
request whose leading full blocks have the same keys shares those device blocks instead of
computing them again. A freed block keeps its key and stays reusable until it is handed out for
new tokens (least recently freed first; blocks without a key go first).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from tiered_kv.engine.sequence import Sequence

logger = logging.getLogger(__name__)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[bytes | None] = [None] * num_blocks
        self.key_to_block: dict[bytes, int] = {}
        # refcount-0 blocks in eviction order (first = next to be handed out)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix reuse --------------------------------------------------------------------------
    def get_cached_blocks(self, seq: Sequence) -> list[int]:
        """Device blocks holding the request's leading full prompt blocks (side-effect free).

        Never covers the last prompt token: the engine computes at least one token.
        """
        if not self.enable_prefix_caching:
            return []
        keys = seq.key_chain.update(seq.prompt_token_ids)
        limit = (seq.num_prompt_tokens - 1) // self.block_size
        hits: list[int] = []
        for key in keys[:limit]:
            block_id = self.key_to_block.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def num_blocks_to_take(self, hit_blocks: list[int], num_blocks: int) -> int:
        """Free-list entries that allocating ``num_blocks`` blocks with these hits consumes."""
        idle_hits = sum(1 for b in hit_blocks if self.ref_counts[b] == 0)
        return num_blocks - len(hit_blocks) + idle_hits

    # ---- allocation ----------------------------------------------------------------------------
    def can_allocate(self, hit_blocks: list[int], num_blocks: int) -> bool:
        return self.num_blocks_to_take(hit_blocks, num_blocks) <= self.num_free_blocks

    def acquire_cached(self, seq: Sequence, hit_blocks: list[int]) -> None:
        """First half of :meth:`allocate`: take references on the request's prefix hits."""
        if seq.block_ids:
            raise RuntimeError(f"{seq.request_id} already has blocks")
        for block_id in hit_blocks:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
            self.ref_counts[block_id] += 1
        seq.block_ids = list(hit_blocks)
        seq.num_registered_blocks = len(hit_blocks)

    def allocate(self, seq: Sequence, num_blocks: int) -> None:
        """Give the request fresh blocks until it has ``num_blocks`` (after :meth:`acquire_cached`)."""
        need = num_blocks - len(seq.block_ids)
        if need > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {need}, {self.num_free_blocks} free")
        for _ in range(need):
            seq.block_ids.append(self._take_free())

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether blocks for ``num_tokens`` tokens of this request can be had."""
        return self.blocks_for(num_tokens) - len(seq.block_ids) <= self.num_free_blocks

    def may_append(self, seq: Sequence, num_tokens: int) -> int:
        """Grow the request's block table to hold ``num_tokens`` tokens; returns blocks added."""
        added = 0
        while len(seq.block_ids) < self.blocks_for(num_tokens):
            seq.block_ids.append(self._take_free())
            added += 1
        return added

    def free(self, seq: Sequence) -> None:
        """Drop the request's references; blocks reaching zero go back to the free list."""
        self.release(reversed(seq.block_ids))
        seq.block_ids = []
        seq.num_registered_blocks = 0

    def set_aside(self, seq: Sequence, block_ids: list[int]) -> None:
        """Give the request fresh blocks in place of ``block_ids``; its references on those become
        the caller's (:meth:`release` drops them)."""
        if len(block_ids) > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {len(block_ids)}, {self.num_free_blocks} free")
        where = {block_id: i for i, block_id in enumerate(seq.block_ids)}
        for block_id in block_ids:
            seq.block_ids[where[block_id]] = self._take_free()

    def release(self, block_ids) -> None:
        """Drop one reference on each block; blocks reaching zero go back to the free list."""
        for block_id in block_ids:
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] < 0:
                raise RuntimeError(f"block {block_id} freed twice")
            if self.ref_counts[block_id] == 0:
                self._free[block_id] = None
                if self.block_keys[block_id] is None:
                    self._free.move_to_end(block_id, last=False)  # useless for reuse: hand out first

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        key = self.block_keys[block_id]
        if key is not None:
            if self.key_to_block.get(key) == block_id:
                del self.key_to_block[key]
            self.block_keys[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    # ---- publishing ----------------------------------------------------------------------------
    def register_computed_blocks(self, seq: Sequence) -> int:
        """Publish the request's full blocks whose KV is computed; returns how many were new."""
        if not self.enable_prefix_caching:
            return 0
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_registered_blocks:
            return 0
        keys = seq.key_chain.update(seq.token_ids[: num_full * self.block_size])
        published = 0
        for index in range(seq.num_registered_blocks, num_full):
            key, block_id = keys[index], seq.block_ids[index]
            if key not in self.key_to_block and self.block_keys[block_id] is None:
                self.key_to_block[key] = block_id
                self.block_keys[block_id] = key
                published += 1
        seq.num_registered_blocks = num_full
        return published
