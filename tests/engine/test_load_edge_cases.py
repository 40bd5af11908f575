"""Edges of the engine's connector loads: failures reported before an async load completes, a
load whose every block failed, unaligned claims over a prompt of whole blocks, a rolled-back step
that must not draw a sampled token, and a full pool behind a load in flight. Every scenario ends
with the connector-free engine's tokens and every block back on the free list."""

from __future__ import annotations

from tests.engine.conftest import make_engine, random_prompt, tiny_model
from tests.engine.memory_connector import MemoryConnector
from tiered_kv.engine import EngineConfig, SamplingParams, engine_namespace, weights_revision
from tiered_kv.engine.sequence import RequestStatus
from tiered_kv.keys import block_keys

PARAMS = SamplingParams(max_tokens=6)
NAMESPACE = engine_namespace(tiny_model(), EngineConfig(), weights_revision(tiny_model(), seed=0))
PROMPT = random_prompt(100, seed=21)  # six full blocks and 4 tokens


def saved_store(prompts=(PROMPT,), params=PARAMS) -> tuple[dict, list]:
    connector = MemoryConnector(NAMESPACE)
    outputs = make_engine(connector=connector).generate(list(prompts), params)
    return connector.store, outputs


def run(engine, max_steps: int = 200) -> dict:
    """Step to completion (and every held block released); outputs by request id."""
    done, steps = {}, 0
    while engine.has_unfinished_requests() or engine.num_held_requests:
        done.update((o.request_id, o) for o in engine.step())
        steps += 1
        assert steps < max_steps, "the engine stopped making progress"
    kv = engine.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.get_max_resource_count() and not any(kv.block_manager.ref_counts)
    assert kv.get_num_available_blocks() == kv.get_max_resource_count()
    return done


def test_errors_reported_before_an_async_load_completes_still_roll_it_back():
    store, [reference] = saved_store()
    bad_key = block_keys(NAMESPACE, PROMPT)[2]
    connector = MemoryConnector(NAMESPACE, store, load_async=True, load_delay=3, fail_keys={bad_key},
                                early_errors=True, save=False)
    engine = make_engine(connector=connector)
    request_id = engine.add_request(PROMPT, PARAMS)
    engine.step()  # admitted; the failed block is reported now, the load completes 3 polls later
    request = engine.get_request(request_id)
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS and not connector._errors
    out = run(engine)[request_id]
    assert out.output_token_ids == reference.output_token_ids
    assert (out.num_external_tokens, out.num_prefilled_tokens) == (32, 100 - 32)


def test_an_async_load_whose_every_block_failed_resumes_from_the_device_hit():
    store, [reference] = saved_store()
    keys = block_keys(NAMESPACE, PROMPT)
    connector = MemoryConnector(NAMESPACE, store, load_async=True, fail_keys=set(keys[3:6]), save=False)
    engine = make_engine(connector=connector)
    engine.add_request(PROMPT[:48] + [7, 8, 9], PARAMS)
    run(engine)  # leaves blocks 0..2 on the device
    request_id = engine.add_request(PROMPT, PARAMS)
    out = run(engine)[request_id]
    assert out.output_token_ids == reference.output_token_ids
    assert (out.num_cached_tokens, out.num_external_tokens, out.num_prefilled_tokens) == (48, 0, 52)


def test_an_unaligned_claim_over_a_prompt_of_whole_blocks_still_computes_its_last_block():
    prompt = PROMPT[:64]  # exactly four blocks: the last one holds the token that is sampled from
    store, [reference] = saved_store([prompt])
    for load_async in (False, True):
        connector = MemoryConnector(NAMESPACE, store, load_async=load_async, match_extra=7)
        engine = make_engine(connector=connector)
        request_id = engine.add_request(prompt, PARAMS)
        out = run(engine)[request_id]
        assert out.output_token_ids == reference.output_token_ids
        assert (out.num_external_tokens, out.num_prefilled_tokens) == (48, 16)


def test_a_rolled_back_sync_load_does_not_draw_from_the_request_sampler():
    sampled = SamplingParams(max_tokens=8, temperature=0.9, seed=1234)
    store, _ = saved_store()
    reference = make_engine().generate([PROMPT], sampled)[0]
    bad_key = block_keys(NAMESPACE, PROMPT)[4]
    connector = MemoryConnector(NAMESPACE, store, fail_keys={bad_key}, save=False)
    engine = make_engine(connector=connector)
    request_id = engine.add_request(PROMPT, sampled)
    out = run(engine)[request_id]
    assert out.num_external_tokens == 64 and out.num_prefilled_tokens == 4 + 100 - 64  # first pass redone
    assert out.output_token_ids == reference.output_token_ids


def test_a_full_pool_admits_the_next_request_once_the_async_load_ahead_of_it_is_done():
    other = random_prompt(90, seed=22)
    store, references = saved_store([PROMPT, other])
    connector = MemoryConnector(NAMESPACE, store, load_async=True, load_delay=4, hold=True, save_delay=3)
    engine = make_engine(connector=connector, num_blocks=8)  # one request of 7 blocks at a time
    first, second = engine.add_request(PROMPT, PARAMS), engine.add_request(other, PARAMS)
    engine.step()
    assert engine.get_request(first).status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert engine.get_request(second).status is RequestStatus.WAITING and not engine.get_request(second).block_ids
    done = run(engine)
    assert [done[first].output_token_ids, done[second].output_token_ids] == [r.output_token_ids for r in references]
    assert done[second].num_external_tokens == 80
