"""bench_e2e's one engine configuration, shared by every child and the parent: the demo model
(fp32), block 16, one-step prefill up to 8192 tokens, a connector with sync loads over a host
tier and an LMDB write-through disk tier; the prompts (seeded random tokens), the warm-up request
and the model's size figures for the report."""

from __future__ import annotations

import random

BLOCK_SIZE = 16
MAX_BATCHED_TOKENS = 8192  # one-step prefill up to 8192 tokens
GEN_TOKENS = 8  # generated per TTFT request (greedy); their equality is checked
# warm/cold TTFT at most: the floor (the figures of the run it was written against: 0.094
# at 2,048 tokens, 0.037 at 8,192; longer prompts held to the 8,192 one); shorter prompts: none
TARGET_RATIOS = ((8192, 0.037), (2048, 0.094))  # (from this many tokens, the ratio), longest first
TARGET_FROM = 4096  # (prompts shorter than this get the cold run repeated as often as the warm)


def target_ratio(length: int) -> float | None:
    """The warm/cold TTFT ratio a prompt of ``length`` tokens must reach (None: no target)."""
    return next((ratio for start, ratio in TARGET_RATIOS if length >= start), None)
TARGET_OVERHEAD_PCT = 5.0
CHILD_TIMEOUT_S = 900


def model_config(max_position: int):
    from tiered_kv.engine import ModelConfig

    return ModelConfig.demo(max_position=max_position)


def engine_config(max_tokens_per_request: int, batch: int = 1):
    from tiered_kv.engine import EngineConfig

    blocks = batch * (-(-max_tokens_per_request // BLOCK_SIZE)) + 64
    return EngineConfig(block_size=BLOCK_SIZE, num_blocks=max(256, blocks),
                        max_num_batched_tokens=MAX_BATCHED_TOKENS)


def block_bytes(model) -> int:
    import torch

    itemsize = getattr(torch, model.dtype).itemsize
    return model.num_layers * 2 * BLOCK_SIZE * model.num_kv_heads * model.head_dim * itemsize


def store_config(store_dir: str, host_bytes: int, layerwise: bool = True) -> dict:
    # restore_policy "always": every stored block is loaded, so the runs compare load paths
    # (tools/bench_restore.py measures the cost policy)
    return {"host": {"capacity": host_bytes}, "layerwise_loads": layerwise, "restore_policy": "always",
            "disk": {"url": f"lmdb://{store_dir}", "capacity": "4GiB", "policy": "write_through"}}


def build(max_position: int, max_tokens_per_request: int, store_dir: str | None, batch: int = 1,
          layerwise: bool = True, save: bool = True):
    """(engine, connector or None): the benchmark's one engine configuration (``save`` False: the
    disk tier is read, never written)."""
    from tiered_kv.config import TieredKVConfig
    from tiered_kv.connector import build_connector
    from tiered_kv.engine import LLMEngine, engine_namespace, weights_revision

    model = model_config(max_position)
    engine_cfg = engine_config(max_tokens_per_request, batch)
    connector = None
    if store_dir is not None:
        ns = engine_namespace(model, engine_cfg, weights_revision(model, seed=0))
        # room for twice the blocks of one run (loads promote into it, saves stage through it)
        host = max(64 << 20, 2 * engine_cfg.num_blocks * block_bytes(model))
        config = store_config(store_dir, host, layerwise)
        if not save:
            config["disk"]["policy"] = "off"
        connector = build_connector(TieredKVConfig.from_dict(config), ns, load_async=False)
    return LLMEngine(model, engine_cfg, connector, seed=0), connector


def build_engine(max_position: int, max_tokens_per_request: int, config):
    """(engine, connector) of the benchmark's engine configuration on the store ``config`` (a
    TieredKVConfig; a host tier of at least twice the KV pool)."""
    from dataclasses import replace

    from tiered_kv.connector import build_connector
    from tiered_kv.engine import LLMEngine, engine_namespace, weights_revision

    model = model_config(max_position)
    engine_cfg = engine_config(max_tokens_per_request)
    ns = engine_namespace(model, engine_cfg, weights_revision(model, seed=0))
    host = max(64 << 20, 2 * engine_cfg.num_blocks * block_bytes(model))
    config = replace(config, host=replace(config.host, capacity=max(config.host.capacity, host)))
    connector = build_connector(config, ns, load_async=False)
    return LLMEngine(model, engine_cfg, connector, seed=0), connector


def prompt_tokens(n: int, seed: int, vocab: int = 4096) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(n)]


def warm_up(engine) -> None:
    """First-call costs (allocator, kernels) off the measured request; 8 tokens fill no block,
    so nothing is looked up, loaded or saved."""
    from tiered_kv.engine import SamplingParams

    engine.generate([list(range(1, 9))], SamplingParams(max_tokens=2, temperature=0.0))


def model_info(max_position: int) -> dict:
    model = model_config(max_position)
    h, i, L = model.hidden_size, model.intermediate_size, model.num_layers
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    params = model.vocab_size * h * 2 + L * (h * (2 * q + 2 * kv) + 3 * h * i + 2 * h) + h
    itemsize = 4 if model.dtype == "float32" else 2
    return {"config": model.to_dict(), "params_m": round(params / 1e6, 2),
            "weights_mib": round(params * itemsize / 2**20, 1),
            "block_shape": [L, 2, BLOCK_SIZE, model.num_kv_heads, model.head_dim],
            "block_bytes": block_bytes(model),
            "kv_bytes_per_token": block_bytes(model) // BLOCK_SIZE}
