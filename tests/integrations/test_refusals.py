"""What tiered-kv cannot do correctly stops start-up with one line naming the setting: context
and pipeline parallelism, a block size vLLM changed under the keys, KV tensors whose blocks hold
another number of tokens than the keys cover, KV in a dtype tiered-kv cannot name.

vLLM logs the line as ``tiered-kv: …`` (the one line to read in its start-up log)."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import torch

from tests.integrations.trtllm_executor import KvCacheConfig, LlmArgs, write_model_config
from tests.integrations.vllm_engine import BS, DIM, HEADS, FullAttentionSpec, kv_cache_config, vllm_config
from tiered_kv.connector.layout import make_layout
from tiered_kv.errors import ConfigError
from tiered_kv.integrations.trtllm import TieredKVScheduler, TieredKVWorker
from tiered_kv.integrations.vllm import KVConnectorRole, TieredKVConnector
from tiered_kv.keys import Namespace


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("TIERED_KV_")]:
        monkeypatch.delenv(name)


def refused_vllm_start(caplog, cfg, spec=None, role=KVConnectorRole.SCHEDULER) -> str:
    """The one ConfigError line of a vLLM start-up, checked to be logged as ``tiered-kv: …``."""
    with caplog.at_level(logging.ERROR), pytest.raises(ConfigError) as err:
        TieredKVConnector(cfg, role, kv_cache_config(spec))
    line = str(err.value)
    assert "\n" not in line
    assert f"tiered-kv: {line}" in [r.getMessage() for r in caplog.records]
    return line


def parallel_config(**sizes) -> SimpleNamespace:
    return SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, **sizes)


@pytest.mark.parametrize("attr", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallelism_is_refused_at_start_up(caplog, attr):
    cfg = vllm_config({})
    cfg.parallel_config = parallel_config(**{attr: 2})
    line = refused_vllm_start(caplog, cfg)
    assert f"{attr}=2" in line and "context parallelism" in line


def test_context_parallelism_of_one_is_fine():
    cfg = vllm_config({})
    cfg.parallel_config = parallel_config(decode_context_parallel_size=1, prefill_context_parallel_size=1)
    TieredKVConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config()).shutdown()


def test_pipeline_parallelism_is_refused_at_start_up_by_both_adapters(caplog, tmp_path, monkeypatch):
    cfg = vllm_config({})
    cfg.parallel_config = parallel_config()
    cfg.parallel_config.pipeline_parallel_size = 2
    assert "pipeline parallelism" in refused_vllm_start(caplog, cfg)
    write_model_config(tmp_path / "model")
    monkeypatch.setenv("TIERED_KV_DISK_URL", f"lmdb://{tmp_path}/db")
    with pytest.raises(ConfigError, match="pipeline_parallel_size=2"):
        TieredKVScheduler(LlmArgs(str(tmp_path / "model"), KvCacheConfig(), pipeline_parallel_size=2))


def test_a_vllm_block_size_raised_over_cache_config_block_size_is_refused(caplog):
    cfg = vllm_config({})
    cfg.cache_config = SimpleNamespace(block_size=BS, cache_dtype="auto")
    line = refused_vllm_start(caplog, cfg, FullAttentionSpec(block_size=4 * BS))
    assert f"{4 * BS} tokens per block" in line and f"cache_config.block_size is {BS}" in line


def test_vllm_kv_caches_with_another_tokens_per_block_are_refused_naming_both(tmp_path, caplog):
    worker = TieredKVConnector(vllm_config({"disk": {"url": f"lmdb://{tmp_path}/db"}}), KVConnectorRole.WORKER,
                               kv_cache_config())
    try:
        # kernel blocks of half the size: twice as many blocks, each half a key's tokens
        caches = {f"l{i}": torch.zeros(32, 2, BS // 2, HEADS, DIM) for i in range(2)}
        with caplog.at_level(logging.ERROR), pytest.raises(ConfigError, match=f"hold {BS // 2} tokens") as err:
            worker.register_kv_caches(caches)
        assert f"keys cover {BS} tokens" in str(err.value)
        assert any(str(err.value) in r.getMessage() and r.getMessage().startswith("tiered-kv: ")
                   for r in caplog.records)
    finally:
        worker.shutdown()


def test_a_trtllm_pool_with_another_tokens_per_block_is_refused(tmp_path, monkeypatch):
    write_model_config(tmp_path / "model")
    monkeypatch.setenv("TIERED_KV_DISK_URL", f"lmdb://{tmp_path}/db")
    worker = TieredKVWorker(LlmArgs(str(tmp_path / "model"), KvCacheConfig(tokens_per_block=BS)))
    try:
        pool = torch.zeros(16, 2, 2, 2 * BS * HEADS * DIM)  # [blocks, layers, K/V, 8 tokens x heads x dim]
        with pytest.raises(ConfigError, match=f"hold {2 * BS} tokens .* keys cover {BS} tokens"):
            worker.register_kv_caches(pool)
    finally:
        worker.close()


@pytest.mark.parametrize("tensor", [torch.zeros(2, 3, 10, 8, 2, 8), torch.zeros(10, 3, 2, 2, 2, 8)])
def test_one_buffer_layouts_with_another_tokens_per_block_are_refused(tensor):
    ns = Namespace(model_id="m", dtype="float32", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)
    with pytest.raises(ConfigError, match=f"hold {tensor.shape[3]} tokens"):
        make_layout(ns, tensor)


def test_kv_tensors_of_another_dtype_than_the_namespace_are_refused():
    ns = Namespace(model_id="m", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)
    caches = [torch.zeros(8, 2, 4, 2, 4, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(ConfigError, match="KV tensors are bfloat16 but the namespace says float32"):
        make_layout(ns, caches)


def test_a_vllm_kv_cache_of_bytes_that_are_not_fp8_is_refused(caplog):
    cfg = vllm_config({})
    cfg.cache_config = SimpleNamespace(block_size=BS, cache_dtype="auto", calculate_kv_scales=False)
    line = refused_vllm_start(caplog, cfg, FullAttentionSpec(dtype=torch.uint8))
    assert "uint8 KV cache" in line and "cache_dtype=auto" in line
