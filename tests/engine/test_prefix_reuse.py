"""Requests sharing a prefix reuse device blocks (same chained keys) and produce the same tokens."""

from __future__ import annotations

from tests.engine.conftest import make_engine, random_prompt
from tiered_kv.engine import SamplingParams

PARAMS = SamplingParams(max_tokens=6)


def test_second_request_with_shared_prefix_reuses_device_blocks():
    shared = random_prompt(100, seed=1)
    first_prompt, second_prompt = shared + random_prompt(7, seed=2), shared + random_prompt(30, seed=3)
    engine = make_engine()
    first = engine.generate([first_prompt], PARAMS)[0]
    second = engine.generate([second_prompt], PARAMS)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 96  # the 6 full blocks of the shared 100 tokens
    assert second.num_prefilled_tokens == len(second_prompt) - 96
    reference = make_engine().generate([second_prompt], PARAMS)[0]
    assert second.output_token_ids == reference.output_token_ids


def test_identical_prompt_still_computes_its_last_token():
    prompt = random_prompt(64, seed=4)  # exactly 4 blocks
    engine = make_engine()
    first = engine.generate([prompt], PARAMS)[0]
    again = engine.generate([prompt], PARAMS)[0]
    assert again.num_cached_tokens == 48 and again.num_prefilled_tokens == 16
    assert again.output_token_ids == first.output_token_ids


def test_generated_tokens_blocks_are_reusable_by_a_follow_up_turn():
    prompt = random_prompt(30, seed=5)
    engine = make_engine()
    turn = engine.generate([prompt], SamplingParams(max_tokens=20))[0]
    follow_up = prompt + turn.output_token_ids + random_prompt(5, seed=6)
    out = engine.generate([follow_up], PARAMS)[0]
    assert out.num_cached_tokens == 48  # 49 computed tokens (30 prompt + 19 decoded) = 3 full blocks
    assert out.output_token_ids == make_engine().generate([follow_up], PARAMS)[0].output_token_ids


def test_concurrent_requests_share_blocks_and_free_them_all():
    shared = random_prompt(64, seed=7)
    engine = make_engine(num_blocks=64)
    engine.generate([shared + [1]], PARAMS)
    kv = engine.kv_cache_manager
    prompts = [shared + random_prompt(10, seed=s) for s in range(3)]
    ids = [engine.add_request(p, PARAMS) for p in prompts]
    engine.step()
    tables = kv.get_batch_cache_indices(ids)
    assert tables[0][:4] == tables[1][:4] == tables[2][:4]  # one copy of the shared prefix
    assert all(kv.block_manager.ref_counts[b] == 3 for b in tables[0][:4])
    while engine.has_unfinished_requests():
        engine.step()
    assert kv.get_num_free_blocks() == kv.get_max_resource_count()


def test_small_pool_evicts_cached_blocks_and_stays_correct():
    engine = make_engine(num_blocks=12)  # room for one request at a time
    prompts = [random_prompt(120, seed=s) for s in range(4)]
    outputs = engine.generate(prompts + prompts[:1], PARAMS)
    reference = make_engine().generate(prompts[:1], PARAMS)[0]
    assert outputs[0].output_token_ids == outputs[-1].output_token_ids == reference.output_token_ids
    assert outputs[-1].num_cached_tokens == 0  # its blocks were handed to the later requests


def test_prefix_caching_can_be_switched_off():
    prompt = random_prompt(50, seed=8)
    engine = make_engine(enable_prefix_caching=False)
    engine.generate([prompt], PARAMS)
    assert engine.generate([prompt], PARAMS)[0].num_cached_tokens == 0
