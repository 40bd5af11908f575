"""Greedy decoding is deterministic; seeded sampling is reproducible and independent of batching."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import make_engine, random_prompt
from tiered_kv.engine import SamplingParams
from tiered_kv.engine.sampler import Sampler
from tiered_kv.errors import ConfigError

PROMPTS = [random_prompt(n, seed=100 + n) for n in (9, 40, 3)]


def tokens(outputs):
    return [o.output_token_ids for o in outputs]


def test_greedy_is_deterministic_across_runs_and_engines():
    params = SamplingParams(max_tokens=8)
    first = tokens(make_engine().generate(PROMPTS, params))
    again = make_engine()
    assert tokens(again.generate(PROMPTS, params)) == first
    assert tokens(again.generate(PROMPTS, params)) == first  # now with device prefix hits


def test_seeded_sampling_reproduces_and_seeds_matter():
    params = [SamplingParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=s) for s in (1, 2, 3)]
    first = tokens(make_engine().generate(PROMPTS, params))
    assert tokens(make_engine().generate(PROMPTS, params)) == first
    other = [SamplingParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=s) for s in (4, 5, 6)]
    assert tokens(make_engine().generate(PROMPTS, other)) != first


def test_seeded_sample_does_not_depend_on_batch_neighbours():
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=7)
    alone = make_engine().generate([PROMPTS[1]], params)[0].output_token_ids
    batched = make_engine().generate(PROMPTS, [SamplingParams(max_tokens=4, temperature=1.0, seed=9), params,
                                               SamplingParams(max_tokens=12)])
    assert batched[1].output_token_ids == alone


def test_unseeded_sampling_is_reproducible_given_engine_seed():
    params = SamplingParams(max_tokens=10, temperature=1.0)
    assert tokens(make_engine().generate(PROMPTS, params)) == tokens(make_engine().generate(PROMPTS, params))


def test_top_k_one_is_greedy_and_stop_tokens_end_generation():
    engine = make_engine()
    greedy = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8))[0]
    top1 = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=1.5, top_k=1, seed=3))[0]
    assert top1.output_token_ids == greedy.output_token_ids
    stop = greedy.output_token_ids[3]
    stopped = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8, stop_token_ids=(stop,)))[0]
    first_stop = greedy.output_token_ids.index(stop)
    assert stopped.output_token_ids == greedy.output_token_ids[: first_stop + 1]
    assert stopped.finish_reason == "stop" and greedy.finish_reason == "length"


def test_top_p_keeps_the_smallest_nucleus():
    sampler = Sampler()
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = set()
    for seed in range(200):
        sampler.add_request("r", seed)
        seen.add(sampler.sample(logits, ["r"], [SamplingParams(temperature=1.0, top_p=0.75, seed=seed)])[0])
    assert seen == {0, 1}


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1.0), dict(temperature=float("nan")),
                                 dict(temperature=float("inf")), dict(top_p=0.0), dict(top_k=-2), dict(seed="x")])
def test_invalid_sampling_params_raise_config_error(bad):
    with pytest.raises(ConfigError):
        SamplingParams(**bad)


def test_regression_a_tiny_temperature_made_the_sampler_raise_into_the_engine():
    """Logits divided by 1e-40 overflowed to inf, softmax gave nan, and torch.multinomial
    raised in the middle of a step; a tiny temperature now samples the most likely token."""
    sampler = Sampler()
    logits = torch.tensor([[2.0, 5.0, -1.0, 4.9]])
    for seed in range(20):
        sampler.add_request("r", seed)
        assert sampler.sample(logits, ["r"], [SamplingParams(temperature=1e-40, seed=seed)]) == [1]
