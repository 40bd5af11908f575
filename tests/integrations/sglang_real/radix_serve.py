"""The producer that lets SGLang's write policy decide when pages reach L3 (``radix_roles serve``).

Nothing here calls the kit's backup helpers: requests are inserted into the radix tree as the
scheduler does after a prefill, and the tree's own triggers start the host backup, whose
acknowledgement starts the L3 write (``_finish_write_through_ack`` -> ``write_backup_storage``):

- ``write_through``: the first request's pages are backed up (hit threshold 1);
- ``write_through_selective``: only once the same prefix is hit a second time (threshold 2), so
  the scenario sends the same prompt again;
- ``write_back``: never on insert; the device-to-host backup runs when the tree evicts the pages
  from the device, so the scenario evicts them.

The result says how many of the sequence's pages L3 holds before that trigger and after it.
"""

from __future__ import annotations

from array import array

import torch

from tests.integrations.sglang_real.radix_roles import _full_kv, _randomize, _role_class
from tests.integrations.sglang_real.scheduler_steps import settle_writes


def _request(role, cache, allocator, tokens: list[int], seed: int):
    """A finished prefill: fresh device slots holding random KV, inserted under ``tokens``."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    slots = role._alloc(allocator, len(tokens)).to(torch.int64)
    _randomize(role, allocator, slots, seed=seed)
    cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots))
    return slots


def _stored_pages(cache, tokens: list[int], page_size: int) -> int:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    hashes = get_storage_hash_str(tokens, None, page_size=page_size)
    return cache.cache_controller.storage_backend.batch_exists(hashes, HiCacheStorageExtraInfo(prefix_keys=None))


def serve(settings: dict) -> dict:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.test.kits.unified_radix_cache.fixtures import build_fixture

    role = _role_class({**settings, "tree_writes": True})()
    try:
        cache, allocator, _ = build_fixture(role.cfg)
        role._init_hicache(cache)
        seq, policy, ps = settings["tokens"], settings["write_policy"], settings["page_size"]
        seed = settings.get("seed", 11)
        slots = _request(role, cache, allocator, seq, seed=seed)
        torch.save(_full_kv(role, allocator, slots), settings["expected"])
        settle_writes(cache)
        before = _stored_pages(cache, seq, ps)
        if policy == "write_through_selective":
            _request(role, cache, allocator, seq, seed=seed + 1)  # same prompt: the tree keeps the first KV
        elif policy == "write_back":
            cache.evict(EvictParams(num_tokens=len(seq)))
        settle_writes(cache)
        return {"stored_before_trigger": before, "stored_pages": _stored_pages(cache, seq, ps),
                "pages": len(seq) // ps}
    finally:
        role.doCleanups()
