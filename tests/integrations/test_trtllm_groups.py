"""TensorRT-LLM's layer groups (one per attention window size) and the adapter: the per-layer-group
calls and ``register_kv_cache_layout`` of ``KVCacheManagerV2`` followed for one full-attention
group, windows refused with one ConfigError line (``trtllm_executor`` stands in for PyExecutor)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.integrations.test_trtllm import PROMPTS, matched, run
from tests.integrations.trtllm_executor import (
    Executor,
    KvCacheConfig,
    KvCacheLayout,
    LayerGroupLayout,
    LlmArgs,
    LlmRequest,
    RequestData,
    SchedulerOutput,
    store_llm_args,
    write_model_config,
)
from tiered_kv.errors import ConfigError
from tiered_kv.integrations.trtllm import TieredKVScheduler, TieredKVWorker


@pytest.fixture
def llm_args(tmp_path, monkeypatch):
    return store_llm_args(tmp_path, monkeypatch)


def run_v2(llm_args, prompts):
    sched, worker = TieredKVScheduler(llm_args), TieredKVWorker(llm_args)
    ex = Executor(sched, worker, v2=True)
    for rid, p in prompts.items():
        ex.add(rid, p)
    try:
        return ex.run(), ex
    finally:
        sched.close()
        worker.close()


def test_one_layer_group_through_the_v2_calls_hits_like_the_flat_calls(llm_args):
    reference, _ = run(llm_args, PROMPTS, connector=False)
    first, ex1 = run_v2(llm_args, PROMPTS)  # a layout registered, block ids per layer group
    assert first == reference and all(m == (0, False) for m in matched(ex1).values())
    second, ex2 = run_v2(llm_args, PROMPTS)
    assert second == reference
    assert matched(ex2) == {1: (28, False), 2: (16, False), 3: (20, False)}
    assert ex2.computed_tokens == (30 - 28) + (17 - 16) + (24 - 20) + 3 * 2
    # the same bytes as the flat calls store: a V1 engine hits what the V2 engine saved
    third, ex3 = run(llm_args, PROMPTS)
    assert third == reference and matched(ex3) == matched(ex2)


def _with_model(tmp_path, **hf) -> str:
    path = tmp_path / "model"
    write_model_config(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **hf}))
    return str(path)


@pytest.mark.parametrize("windows, max_seq_len, hf, where", [
    ([8, 64], None, {}, "has 2 window sizes"),
    ([8], 64, {}, "below max_seq_len=64"),
    (None, None, {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
     "layer_types has 1 full_attention, 1 sliding_attention"),
    (None, None, {"sliding_window_pattern": 6, "sliding_window": 512}, "sliding_window_pattern=6"),
    (None, None, {"attention_chunk_size": 8192}, "attention_chunk_size=8192"),
    (None, None, {"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
    ([8], None, {"max_position_embeddings": 64}, "below max_seq_len=64"),  # max_seq_len unset: the model's
    (None, None, {"model_type": "gemma2", "sliding_window": 4096, "cache_implementation": "hybrid"}, "gemma2"),
    (None, None, {"hybrid_override_pattern": "M-*-M*"}, "recurrent Mamba/SSM layers"),
    (None, None, {"layers_block_type": ["mamba", "attention"]}, "recurrent Mamba/SSM layers"),
])
def test_a_model_with_an_attention_window_is_refused_when_either_half_is_built(
        llm_args, tmp_path, windows, max_seq_len, hf, where):
    args = LlmArgs(_with_model(tmp_path, **hf), KvCacheConfig(max_attention_window=windows), max_seq_len=max_seq_len)
    for half in (TieredKVScheduler, TieredKVWorker):
        with pytest.raises(ConfigError, match=where) as err:
            half(args)
        message = str(err.value)
        assert "\n" not in message and "one layer group" in message and message.startswith("TensorRT-LLM")


@pytest.mark.parametrize("windows, max_seq_len, hf", [
    ([64, 64], 64, {}),  # one window per layer, none below the longest sequence: full attention
    (None, None, {"layer_types": ["full_attention", "full_attention"]}),
    (None, None, {"sliding_window": 4096, "use_sliding_window": False}),  # Qwen2-style, off
    (None, None, {"sliding_window": 4096}),  # a bare window TensorRT-LLM may not apply: guarded later
])
def test_full_attention_configs_are_accepted(llm_args, tmp_path, windows, max_seq_len, hf):
    args = LlmArgs(_with_model(tmp_path, **hf), KvCacheConfig(max_attention_window=windows), max_seq_len=max_seq_len)
    sched, worker = TieredKVScheduler(args), TieredKVWorker(args)
    sched.close()
    worker.close()


def test_calls_with_several_layer_groups_are_refused_naming_the_call(llm_args):
    sched = TieredKVScheduler(llm_args)
    try:
        req = LlmRequest(1, PROMPTS[1], 30, 1)
        sched.get_num_new_matched_tokens(req, 0)
        with pytest.raises(ConfigError, match="update_state_after_alloc_by_layer_group .* 2 KV layer groups"):
            sched.update_state_after_alloc_by_layer_group(req, [[0, 1], [5, 6]])
        so = SchedulerOutput(new_requests=[RequestData(1, PROMPTS[1], [], 0, 30, [[0, 1], [5, 6]])])
        with pytest.raises(ConfigError, match="build_connector_meta .* 2 KV layer groups"):
            sched.build_connector_meta(so)
        with pytest.raises(ConfigError, match="request_finished_by_layer_group .* 3 KV layer groups"):
            sched.request_finished_by_layer_group(req, [[0], [1], [2]])
    finally:
        sched.close()


def test_a_block_without_a_page_is_refused_before_it_can_reach_the_pool(llm_args):
    """``-1`` is a valid subscript: a load planned into it would overwrite the pool's last page
    (another request's KV). Only a window leaves a block without a page, so it is refused."""
    run(llm_args, PROMPTS)  # the store holds the prompts' blocks: a load would be planned
    sched = TieredKVScheduler(llm_args)
    try:
        req = LlmRequest(1, PROMPTS[1], 30, 1)
        assert sched.get_num_new_matched_tokens(req, 0)[0] == 28
        with pytest.raises(ConfigError, match=r"blocks \[1\] have no page \(-1\)"):
            sched.update_state_after_alloc(req, [3, -1, 5, 6, 7, 8, 9, 10])
        with pytest.raises(ConfigError, match="build_connector_meta for request 1: blocks"):
            sched.build_connector_meta(SchedulerOutput(new_requests=[RequestData(1, PROMPTS[1], [3, -1], 0, 30)]))
        with pytest.raises(ConfigError, match="request_finished for request 1"):
            sched.request_finished(req, [-1, -1, 5])
    finally:
        sched.close()


@pytest.mark.parametrize("layout, match", [
    (lambda pool: KvCacheLayout(pool, [LayerGroupLayout(0, 8, (0, 1))]), r"1 layer group\(s\) with attention windows \[8\]"),
    (lambda pool: KvCacheLayout(pool, [LayerGroupLayout(0, None, (0,)), LayerGroupLayout(1, 8, (1,))]),
     r"2 layer group\(s\) with attention windows \[None, 8\]"),
    (lambda pool: KvCacheLayout(pool, single_pool=False), "not one pool"),
])
def test_a_layout_the_adapter_cannot_follow_is_refused_at_registration(llm_args, layout, match):
    worker = TieredKVWorker(llm_args)
    try:
        with pytest.raises(ConfigError, match=match):
            worker.register_kv_cache_layout(layout(torch.zeros(16, 2, 2, 4 * 2 * 4)))
        assert worker.core.layout is None
        worker.register_kv_cache_layout(KvCacheLayout(torch.zeros(16, 2, 2, 4 * 2 * 4)))
        assert worker.core.layout.name == "block_major"
    finally:
        worker.close()
