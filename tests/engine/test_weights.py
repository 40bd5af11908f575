"""Seeded weights round-trip through a Hugging Face-style safetensors directory."""

from __future__ import annotations

import json

import pytest
import torch

from tests.engine.conftest import random_prompt, tiny_model
from tiered_kv.engine import EngineConfig, LLMEngine, SamplingParams
from tiered_kv.engine.weights import save_pretrained, seeded_model
from tiered_kv.errors import ConfigError


def test_safetensors_round_trip_gives_the_same_outputs(tmp_path):
    config = tiny_model()
    seeded = LLMEngine(config, EngineConfig(num_blocks=64), seed=11)
    save_pretrained(seeded.model, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["num_key_value_heads"] == 2 and hf["architectures"] == ["LlamaForCausalLM"]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight",
            "model.layers.0.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight"} <= names

    loaded = LLMEngine(engine_config=EngineConfig(num_blocks=64), model_dir=tmp_path)
    assert loaded.model_config == config
    prompts = [random_prompt(n, seed=n) for n in (5, 40)]
    params = SamplingParams(max_tokens=6)
    assert ([o.output_token_ids for o in loaded.generate(prompts, params)]
            == [o.output_token_ids for o in seeded.generate(prompts, params)])
    assert loaded.namespace.revision != seeded.namespace.revision  # keyed by file content
    again = LLMEngine(engine_config=EngineConfig(num_blocks=64), model_dir=tmp_path)
    assert again.namespace == loaded.namespace


def test_same_seed_same_weights_other_seed_other_weights():
    a, b = seeded_model(tiny_model(), 1), seeded_model(tiny_model(), 1)
    c = seeded_model(tiny_model(), 2)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_loading_as_bfloat16_and_config_mismatch(tmp_path):
    save_pretrained(seeded_model(tiny_model(), 0), tmp_path)
    engine = LLMEngine(tiny_model(dtype="bfloat16"), EngineConfig(num_blocks=32), model_dir=tmp_path)
    assert engine.model.lm_head.weight.dtype == torch.bfloat16
    assert engine.kv_cache_manager.kv_cache.dtype == torch.bfloat16
    with pytest.raises(ConfigError):
        LLMEngine(tiny_model(num_layers=3), EngineConfig(num_blocks=32), model_dir=tmp_path)
    with pytest.raises(ConfigError):
        LLMEngine(engine_config=EngineConfig(num_blocks=32), model_dir=tmp_path / "missing")
