"""A TensorRT-LLM engine with sparse attention (``sparse_attention_config``: RocketKV, DSA) attends
to chosen tokens only, so the K/V of every later layer differ from a dense engine's for the same
tokens: its blocks get a namespace of their own (review ns2). An engine without one keeps its."""

from __future__ import annotations

from dataclasses import dataclass

from tests.integrations.trtllm_executor import KvCacheConfig, LlmArgs, write_model_config
from tiered_kv.integrations.common import parse_settings
from tiered_kv.integrations.trtllm import trtllm_namespace


@dataclass
class SparseLlmArgs(LlmArgs):
    sparse_attention_config: object | None = None


@dataclass
class RocketKVSparseAttentionConfig:
    """TensorRT-LLM's RocketKV config: its declared fields (a few)."""

    algorithm: str = "rocket"
    window_size: int | None = 32
    kernel_size: int | None = 63
    prompt_budget: int | None = 2048


def namespace(tmp_path, **llm):
    model = tmp_path / "llama-like"
    if not model.exists():
        write_model_config(model)
        (model / "model.safetensors").write_bytes(b"weights")
    settings = parse_settings(None, source="t", environ={})
    return trtllm_namespace(SparseLlmArgs(model=str(model), kv_cache_config=KvCacheConfig(), **llm),
                            settings.config)


def test_regression_a_sparse_attention_engine_shared_the_dense_engines_namespace(tmp_path):
    dense = namespace(tmp_path)
    sparse = namespace(tmp_path, sparse_attention_config=RocketKVSparseAttentionConfig())
    assert sparse.digest() != dense.digest()
    assert sparse == namespace(tmp_path, sparse_attention_config=RocketKVSparseAttentionConfig())
    budget = namespace(tmp_path, sparse_attention_config=RocketKVSparseAttentionConfig(prompt_budget=512))
    assert budget.digest() != sparse.digest()


def test_an_engine_without_sparse_attention_keeps_its_namespace(tmp_path):
    assert namespace(tmp_path, sparse_attention_config=None) == namespace(tmp_path)
    assert "+numerics-" not in namespace(tmp_path).revision
