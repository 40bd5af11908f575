"""The engine drives a KV connector in TensorRT-LLM's executor order and honours its answers:
sync and async loads, failed blocks recomputed, finished requests' blocks held until saved."""

from __future__ import annotations

import pytest

from tests.engine.conftest import make_engine, random_prompt, tiny_model
from tests.engine.memory_connector import MemoryConnector
from tiered_kv.engine import EngineConfig, SamplingParams, engine_namespace, weights_revision
from tiered_kv.engine.sequence import RequestStatus
from tiered_kv.keys import block_keys

PARAMS = SamplingParams(max_tokens=6)
NAMESPACE = engine_namespace(tiny_model(), EngineConfig(), weights_revision(tiny_model(), seed=0))
PROMPT = random_prompt(100, seed=21)


def saved_store(prompts=(PROMPT,)) -> tuple[dict, list]:
    """A store filled by a first engine; returns it and that engine's outputs."""
    connector = MemoryConnector(NAMESPACE)
    outputs = make_engine(connector=connector).generate(list(prompts), PARAMS)
    return connector.store, outputs


def test_steps_call_the_connector_in_executor_order():
    connector = MemoryConnector(NAMESPACE)
    engine = make_engine(connector=connector)
    assert connector.calls == ["register_kv_caches"]
    assert connector.kv is engine.kv_cache_manager.kv_cache
    engine.add_request(PROMPT, SamplingParams(max_tokens=2))
    connector.calls.clear()
    engine.step()
    layers = [f"{hook}:{i}" for i in range(2) for hook in ("wait_for_layer_load", "save_kv_layer")]
    assert connector.calls == ["get_num_new_matched_tokens", "update_state_after_alloc",
                               "build_connector_meta", "bind_connector_meta", "start_load_kv", *layers,
                               "wait_for_save", "get_block_ids_with_load_errors", "get_finished"]
    connector.calls.clear()
    [out] = engine.step()
    assert connector.calls == ["build_connector_meta", "bind_connector_meta", "start_load_kv", *layers,
                               "wait_for_save", "get_block_ids_with_load_errors", "request_finished",
                               "get_finished"]
    assert connector.finished_seen == {out.request_id}


def test_scheduler_output_reports_prompt_once_then_deltas():
    store, _ = saved_store()
    connector = MemoryConnector(NAMESPACE, store)
    engine = make_engine(connector=connector)
    engine.generate([PROMPT[:48] + [1, 2, 3]], PARAMS)  # 3 device blocks of the prefix
    connector.scheduler_outputs.clear()
    prompt = PROMPT + random_prompt(28, seed=99)  # 8 blocks; the store has blocks 0..5
    out = engine.generate([prompt], SamplingParams(max_tokens=20))[0]
    first, *rest = connector.scheduler_outputs
    [new] = first.new_requests
    assert new.new_tokens == tuple(prompt) and len(new.new_block_ids) == 8
    assert new.computed_position == 48  # device hit only; connector tokens excluded
    assert out.num_cached_tokens == 48 and out.num_external_tokens == 48  # blocks 3..5 loaded
    assert new.num_scheduled_tokens == 128 - 96
    decodes = [d for o in rest for d in o.cached_requests]
    assert [d.new_tokens for d in decodes] == [(t,) for t in out.output_token_ids[:-1]]
    assert sum(len(d.new_block_ids) for d in decodes) == 2  # positions 128 and 144 open blocks
    assert [d.computed_position for d in decodes] == list(range(128, 147))
    assert rest[-1].finished_req_ids == () and engine.step() == []
    assert connector.scheduler_outputs[-1].finished_req_ids == (out.request_id,)


def test_restarted_engine_loads_saved_blocks_instead_of_prefilling():
    store, [reference] = saved_store()
    connector = MemoryConnector(NAMESPACE, store)
    [out] = make_engine(connector=connector).generate([PROMPT], PARAMS)
    assert out.output_token_ids == reference.output_token_ids
    assert (out.num_cached_tokens, out.num_external_tokens, out.num_prefilled_tokens) == (0, 96, 4)


def test_loads_never_cover_the_last_prompt_token():
    prompt = PROMPT[:64]
    store, [reference] = saved_store([prompt])
    [out] = make_engine(connector=MemoryConnector(NAMESPACE, store)).generate([prompt], PARAMS)
    assert out.num_external_tokens == 48 and out.num_prefilled_tokens == 16
    assert out.output_token_ids == reference.output_token_ids


def test_async_load_waits_until_the_connector_reports_it():
    store, [reference] = saved_store()
    connector = MemoryConnector(NAMESPACE, store, load_async=True, load_delay=3)
    engine = make_engine(connector=connector)
    request_id = engine.add_request(PROMPT, PARAMS)
    engine.step()
    request = engine.get_request(request_id)
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert request.num_computed_tokens == 0 and connector.started_loading_seen == {request_id}
    [new] = connector.scheduler_outputs[0].new_requests
    assert new.num_scheduled_tokens == 0
    engine.step()
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    engine.step()  # third poll: loaded
    assert request.status is RequestStatus.RUNNING and request.num_computed_tokens == 96
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    [out] = outputs
    assert out.output_token_ids == reference.output_token_ids
    assert (out.num_external_tokens, out.num_prefilled_tokens) == (96, 4)


@pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])
def test_failed_block_load_is_recomputed_with_unchanged_output(load_async):
    store, [reference] = saved_store()
    bad_key = block_keys(NAMESPACE, PROMPT)[2]
    connector = MemoryConnector(NAMESPACE, store, load_async=load_async, fail_keys={bad_key}, save=False)
    [out] = make_engine(connector=connector).generate([PROMPT], PARAMS)
    assert out.output_token_ids == reference.output_token_ids
    assert out.num_external_tokens == 32  # the two blocks before the failed one
    expected_prefill = 100 - 32 + (0 if load_async else 4)  # sync: the first pass (4 tokens) is redone
    assert out.num_prefilled_tokens == expected_prefill


def test_a_silently_corrupt_load_would_change_the_output():
    """The failure test above is meaningful: the garbage it loads does change the tokens."""
    store, [reference] = saved_store()
    bad_key = block_keys(NAMESPACE, PROMPT)[2]
    connector = MemoryConnector(NAMESPACE, store, fail_keys={bad_key}, silent_corruption=True, save=False)
    [out] = make_engine(connector=connector).generate([PROMPT], PARAMS)
    assert out.output_token_ids != reference.output_token_ids


def test_held_blocks_stay_allocated_until_reported_saved():
    connector = MemoryConnector(NAMESPACE, hold=True, save_delay=3)
    engine = make_engine(connector=connector, num_blocks=32)
    kv = engine.kv_cache_manager
    held_id = engine.add_request(PROMPT, SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    held_blocks = set(kv.get_batch_cache_indices([held_id])[0])
    assert engine.num_held_requests == 1 and len(held_blocks) == 7
    assert kv.get_num_free_blocks() == 32 - 7
    # another request must not get the held blocks, even when it needs most of the pool
    other_id = engine.add_request(random_prompt(300, seed=5), SamplingParams(max_tokens=2))
    engine.step()
    assert not held_blocks & set(kv.get_batch_cache_indices([other_id])[0])
    while engine.has_unfinished_requests() or engine.num_held_requests:
        engine.step()
    assert kv.get_num_free_blocks() == 32


def test_generate_waits_for_held_blocks_to_be_saved():
    connector = MemoryConnector(NAMESPACE, hold=True, save_delay=2)
    engine = make_engine(connector=connector)
    engine.generate([PROMPT], PARAMS)
    assert engine.num_held_requests == 0
    assert engine.kv_cache_manager.get_num_free_blocks() == engine.kv_cache_manager.get_max_resource_count()
