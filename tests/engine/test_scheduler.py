"""Continuous batching: decodes first, then prefill chunks within the token budget; seat limits."""

from __future__ import annotations

from tests.engine.conftest import make_engine, random_prompt
from tiered_kv.engine import SamplingParams


def test_budget_chunks_prefill_and_decodes_go_first():
    engine = make_engine(max_num_batched_tokens=32)
    a = engine.add_request(random_prompt(20, seed=1), SamplingParams(max_tokens=5))
    engine.step()  # a: 20 prompt tokens; the step samples its first token
    b = engine.add_request(random_prompt(70, seed=2), SamplingParams(max_tokens=5))
    batch = engine.scheduler.schedule()  # planning only: the batch is inspected, not run
    assert [r.request_id for r in batch.requests] == [a, b]
    assert batch.num_scheduled_tokens == {a: 1, b: 31}
    assert [r.request_id for r in batch.new_requests] == [b]


def test_chunk_sizes_across_steps():
    engine = make_engine(max_num_batched_tokens=32)
    request_id = engine.add_request(random_prompt(70, seed=2), SamplingParams(max_tokens=3))
    computed = []
    while engine.has_unfinished_requests():
        engine.step()
        request = engine.get_request(request_id)
        if request is not None:
            computed.append(request.num_computed_tokens)
    assert computed == [32, 64, 70, 71]  # three prefill chunks, then decodes


def test_max_num_seqs_limits_admitted_requests():
    engine = make_engine(max_num_seqs=2)
    ids = [engine.add_request(random_prompt(10, seed=s), SamplingParams(max_tokens=4)) for s in range(3)]
    engine.step()
    assert [bool(engine.get_request(i).block_ids) for i in ids] == [True, True, False]
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert sorted(o.request_id for o in outputs) == sorted(ids)


def test_ttft_counts_from_arrival_to_first_token():
    engine = make_engine(max_num_batched_tokens=16)
    [out] = engine.generate([random_prompt(64, seed=4)], SamplingParams(max_tokens=3))
    assert 0 < out.ttft_s <= out.e2e_s
