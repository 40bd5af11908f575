from __future__ import annotations

import random

import pytest
import torch

from tiered_kv.engine import EngineConfig, LLMEngine, ModelConfig


def tiny_model(**overrides) -> ModelConfig:
    """The test model: a couple of layers, GQA 4:2, 2,000+ tokens in well under a second."""
    return ModelConfig.tiny(**overrides)


def make_engine(model_config: ModelConfig | None = None, seed: int = 0, connector=None,
                **engine_overrides) -> LLMEngine:
    engine_overrides.setdefault("num_blocks", 512)
    engine_overrides.setdefault("max_num_batched_tokens", 2048)
    return LLMEngine(model_config or tiny_model(), EngineConfig(**engine_overrides), connector, seed=seed)


def random_prompt(length: int, seed: int, vocab: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def dense_greedy(engine: LLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens from the cache-free dense forward (full recomputation every token)."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(engine.model.forward_dense(tokens)[-1].float().argmax()))
    return tokens[len(prompt):]


@pytest.fixture(autouse=True, scope="session")
def _two_threads():
    torch.set_num_threads(min(2, torch.get_num_threads()))
