"""Free list, reference counts and prefix reuse of device blocks."""

from __future__ import annotations

from tiered_kv.engine.block_manager import BlockManager
from tiered_kv.engine.sampling_params import SamplingParams
from tiered_kv.engine.sequence import Sequence
from tiered_kv.keys import KeyChain, Namespace

NS = Namespace(model_id="m", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=16, block_size=4)


def seq(name: str, tokens: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(name, tokens, SamplingParams(max_tokens=max_tokens), KeyChain(NS), seed=0)


def computed(manager: BlockManager, request: Sequence, num_blocks: int) -> Sequence:
    manager.acquire_cached(request, manager.get_cached_blocks(request))
    manager.allocate(request, num_blocks)
    request.num_computed_tokens = request.num_prompt_tokens
    manager.register_computed_blocks(request)
    return request


def test_allocate_and_free_return_every_block():
    manager = BlockManager(8, 4)
    a = computed(manager, seq("a", list(range(10))), 3)
    assert manager.num_free_blocks == 5 and a.block_ids == [0, 1, 2]
    manager.free(a)
    assert manager.num_free_blocks == 8 and a.block_ids == []


def test_full_blocks_are_reused_by_key_and_refcounted():
    manager = BlockManager(8, 4)
    a = computed(manager, seq("a", list(range(10))), 3)  # blocks 0, 1 full and published
    b = seq("b", list(range(8)) + [99, 98, 97])
    hits = manager.get_cached_blocks(b)
    assert hits == a.block_ids[:2]
    assert manager.num_blocks_to_take(hits, 3) == 1
    computed(manager, b, 3)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert [manager.ref_counts[i] for i in a.block_ids[:2]] == [2, 2]
    manager.free(a)
    assert [manager.ref_counts[i] for i in b.block_ids[:2]] == [1, 1]


def test_hits_stop_at_the_first_missing_key_and_before_the_last_prompt_token():
    manager = BlockManager(8, 4)
    computed(manager, seq("a", list(range(12))), 3)
    assert len(manager.get_cached_blocks(seq("b", list(range(12))))) == 2  # not the block of the last token
    assert manager.get_cached_blocks(seq("c", [5] + list(range(1, 12)))) == []  # chain broken at block 0


def test_freed_blocks_stay_reusable_until_handed_out_again():
    manager = BlockManager(4, 4)
    a = computed(manager, seq("a", list(range(9))), 3)  # blocks 0, 1 keyed; 2 holds the partial tail
    manager.free(a)
    again = seq("again", list(range(9)))
    assert manager.get_cached_blocks(again) == [0, 1]
    assert manager.num_blocks_to_take([0, 1], 3) == 3  # idle hits still come off the free list
    # unkeyed blocks go first, then keyed ones from the request's tail backwards
    other = seq("other", [7] * 9)
    manager.allocate(other, 2)
    assert sorted(other.block_ids) == [2, 3] and manager.get_cached_blocks(again) == [0, 1]
    manager.free(other)
    manager.allocate(other, 3)
    assert manager.get_cached_blocks(again) == [0]  # block 1's key was evicted, block 0's kept


def test_may_append_grows_one_block_per_block_size_tokens():
    manager = BlockManager(4, 4)
    r = seq("r", [1, 2, 3, 4])
    manager.allocate(r, 1)
    assert manager.can_append(r, 5) and manager.may_append(r, 5) == 1
    assert manager.may_append(r, 8) == 0 and len(r.block_ids) == 2


def test_prefix_caching_off_never_hits():
    manager = BlockManager(8, 4, enable_prefix_caching=False)
    computed(manager, seq("a", list(range(10))), 3)
    assert manager.get_cached_blocks(seq("b", list(range(10)))) == []
