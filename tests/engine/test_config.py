"""Configuration is validated up front with errors that name the field."""

from __future__ import annotations

import pytest

from tests.engine.conftest import make_engine, random_prompt
from tiered_kv.engine import EngineConfig, ModelConfig, SamplingParams
from tiered_kv.errors import ConfigError


@pytest.mark.parametrize("bad, field", [
    (dict(num_heads=6, num_kv_heads=4), "num_kv_heads"),
    (dict(head_dim=15), "head_dim"),
    (dict(dtype="int8"), "dtype"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(rms_eps=0.0), "rms_eps"),
])
def test_model_config_rejects(bad, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**bad)


@pytest.mark.parametrize("bad, field", [
    (dict(block_size=0), "block_size"),
    (dict(num_blocks=-1), "num_blocks"),
    (dict(device="tpu"), "device"),
    (dict(kv_kernel="cuda"), "kv_kernel"),
    (dict(hash_algo="md5"), "hash_algo"),
    (dict(max_num_seqs=True), "max_num_seqs"),
])
def test_engine_config_rejects(bad, field):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**bad)


def test_hf_config_round_trip():
    config = ModelConfig.demo()
    assert ModelConfig.from_hf_config(config.to_hf_config()) == config
    with pytest.raises(ConfigError, match="num_attention_heads"):
        ModelConfig.from_hf_config({"vocab_size": 10})


def test_impossible_requests_are_refused():
    engine = make_engine(num_blocks=4, max_model_len=100)
    with pytest.raises(ConfigError):
        engine.add_request([], SamplingParams())
    with pytest.raises(ConfigError):
        engine.add_request([10**6], SamplingParams())
    with pytest.raises(ConfigError, match="max_model_len"):
        engine.add_request(random_prompt(95, seed=1), SamplingParams(max_tokens=10))
    with pytest.raises(ConfigError, match="blocks"):
        engine.add_request(random_prompt(80, seed=1), SamplingParams(max_tokens=2))
    engine.add_request([1, 2], SamplingParams(), request_id="x")
    with pytest.raises(ConfigError, match="in use"):
        engine.add_request([1, 2], SamplingParams(), request_id="x")


def test_regression_a_generate_call_refused_for_one_prompt_left_the_others_queued():
    """``generate`` checked each prompt as it queued it: a bad second prompt raised after the
    first was queued, which then ran (taking blocks and steps) in the next call, its output lost."""
    engine = make_engine(num_blocks=64, max_num_batched_tokens=256)
    with pytest.raises(ConfigError):
        engine.generate([[1, 2, 3, 4], [10**9]], SamplingParams(max_tokens=4))
    assert not engine.has_unfinished_requests()
    (out,) = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4))
    assert out.prompt_token_ids == [5, 6, 7, 8] and len(out.output_token_ids) <= 4
