"""The KV pool's TensorRT-LLM-style interface and its reservations to completion."""

from __future__ import annotations

import torch

from tests.engine.conftest import make_engine, random_prompt, tiny_model
from tiered_kv.engine import SamplingParams


def test_buffer_layout_and_per_layer_views():
    engine = make_engine(num_blocks=10, block_size=8)
    kv = engine.kv_cache_manager
    config = tiny_model()
    assert kv.kv_cache.shape == (2, config.num_layers, 10, 8, config.num_kv_heads, config.head_dim)
    layer = kv.get_buffers(1)
    assert layer.shape == (2, 10, 8, config.num_kv_heads, config.head_dim)
    assert layer.data_ptr() == kv.kv_cache[0, 1].data_ptr()
    attention = engine.model.attention_layers[1]
    assert attention.k_cache.data_ptr() == kv.kv_cache[0, 1].data_ptr()
    assert attention.v_cache.data_ptr() == kv.kv_cache[1, 1].data_ptr()
    assert kv.get_max_resource_count() == 10 and kv.get_num_free_blocks() == 10


def test_written_kv_lands_in_the_requests_blocks():
    engine = make_engine(num_blocks=16)
    kv = engine.kv_cache_manager
    request_id = engine.add_request(random_prompt(20, seed=1), SamplingParams(max_tokens=30))
    engine.step()
    [blocks] = kv.get_batch_cache_indices([request_id])
    assert len(blocks) == 2
    used = kv.kv_cache.abs().sum(dim=(0, 1, 3, 4, 5)) > 0
    assert set(torch.nonzero(used).flatten().tolist()) == set(blocks)
    request = engine.get_request(request_id)
    # 20 prompt + 30 generated - 1 = 49 tokens of KV at most: 4 blocks, 2 still to come
    assert kv.get_needed_resource_to_completion(request) == 2
    assert kv.get_num_available_blocks() == 16 - 4


def test_admission_waits_until_the_pool_can_hold_a_request_to_completion():
    engine = make_engine(num_blocks=8)
    kv = engine.kv_cache_manager
    params = SamplingParams(max_tokens=17)  # 32 + 16 = 48 tokens of KV: 3 blocks... of 16
    first = engine.add_request(random_prompt(32, seed=2), params)
    second = engine.add_request(random_prompt(100, seed=3), params)  # 116 tokens: 8 blocks
    engine.step()
    assert engine.get_request(first).block_ids and not engine.get_request(second).block_ids
    while engine.get_request(first) is not None:
        engine.step()
    engine.step()
    assert len(kv.get_batch_cache_indices([second])[0]) == 7  # prompt blocks; the 8th is reserved
    assert kv.get_num_available_blocks() == 0
    while engine.has_unfinished_requests():
        engine.step()
    assert kv.get_num_free_blocks() == 8
