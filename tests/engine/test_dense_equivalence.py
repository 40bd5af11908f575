"""The paged engine computes what a dense, cache-free forward computes.

Prompts of 1 to 2,000 tokens (around the block size 16), alone, all at once (continuous batching)
and with a small token budget (chunked prefill whose chunks do not align with blocks).
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import make_engine, random_prompt, tiny_model
from tiered_kv.engine import SamplingParams

LENGTHS = (1, 15, 16, 17, 100, 2000)
MAX_TOKENS = 5
# fp32: paged and dense differ only in summation order; bf16 rounds every activation to 8 bits
LOGIT_ATOL = {"float32": 1e-4, "bfloat16": 0.1}


def run(dtype: str, mode: str):
    budget = {"alone": 4096, "batched": 4096, "chunked": 40}[mode]
    engine = make_engine(tiny_model(dtype=dtype), max_num_batched_tokens=budget)
    prompts = [random_prompt(n, seed=n) for n in LENGTHS]
    params = SamplingParams(max_tokens=MAX_TOKENS, return_logits=True)
    if mode == "alone":
        outputs = [engine.generate([p], params)[0] for p in prompts]
    else:
        outputs = engine.generate(prompts, params)
    return engine, prompts, outputs


@pytest.mark.parametrize("mode", ["alone", "batched", "chunked"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_engine_matches_dense_forward(dtype, mode):
    engine, prompts, outputs = run(dtype, mode)
    for prompt, out in zip(prompts, outputs, strict=True):
        generated = out.output_token_ids
        assert len(generated) == MAX_TOKENS
        assert out.num_prefilled_tokens == len(prompt)
        dense = engine.model.forward_dense(prompt + generated[:-1]).float()[len(prompt) - 1:].cpu()
        paged = torch.stack(out.logits)
        # logits of the last prompt position and of every decode position agree
        torch.testing.assert_close(paged, dense, atol=LOGIT_ATOL[dtype], rtol=0)
        # each greedy token is the dense argmax (in bf16: or within rounding of it)
        best = dense.max(dim=-1).values
        chosen = dense.gather(1, torch.tensor(generated)[:, None])[:, 0]
        if dtype == "float32":
            assert generated == dense.argmax(dim=-1).tolist(), f"prompt of {len(prompt)} tokens"
        else:
            assert torch.all(chosen >= best - LOGIT_ATOL[dtype]), f"prompt of {len(prompt)} tokens"


def test_fp32_greedy_equals_independent_dense_generation():
    engine = make_engine(tiny_model())
    prompt = random_prompt(37, seed=1)
    [out] = engine.generate([prompt], SamplingParams(max_tokens=12))
    tokens = list(prompt)
    for _ in range(12):
        tokens.append(int(engine.model.forward_dense(tokens)[-1].argmax()))
    assert out.output_token_ids == tokens[len(prompt):]


def test_greedy_output_is_not_degenerate():
    engine = make_engine(tiny_model())
    [out] = engine.generate([random_prompt(20, seed=3)], SamplingParams(max_tokens=48))
    assert len(set(out.output_token_ids)) > 8


def test_requests_joining_a_running_batch_get_the_same_tokens_as_alone():
    engine = make_engine(tiny_model(), max_num_batched_tokens=64)
    prompts = [random_prompt(n, seed=10 + n) for n in (70, 5, 33, 129)]
    params = SamplingParams(max_tokens=6)
    alone = [engine.generate([p], params)[0].output_token_ids for p in prompts]
    fresh = make_engine(tiny_model(), max_num_batched_tokens=64)
    fresh.add_request(prompts[0], params, request_id="a")
    done = {}
    steps = 0
    while fresh.has_unfinished_requests() or steps < 3:
        if steps == 2:
            fresh.add_request(prompts[1], params, request_id="b")
            fresh.add_request(prompts[2], params, request_id="c")
        if steps == 4:
            fresh.add_request(prompts[3], params, request_id="d")
        done.update({o.request_id: o.output_token_ids for o in fresh.step()})
        steps += 1
    assert [done[k] for k in "abcd"] == alone
    assert fresh.kv_cache_manager.get_num_free_blocks() == fresh.kv_cache_manager.get_max_resource_count()
