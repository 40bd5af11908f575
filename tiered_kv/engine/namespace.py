"""The namespace of the engine's KV blocks: model shape, dtype, block size and weights revision."""

from __future__ import annotations

from pathlib import Path

from tiered_kv.engine.config import EngineConfig, ModelConfig
from tiered_kv.engine.weights import file_revision, seeded_revision
from tiered_kv.keys import Namespace


def engine_namespace(model_config: ModelConfig, engine_config: EngineConfig, revision: str) -> Namespace:
    """The namespace of this engine's KV blocks (what a connector must use for its keys)."""
    return Namespace(
        model_id=engine_config.model_id, dtype=model_config.dtype, num_layers=model_config.num_layers,
        num_kv_heads=model_config.num_kv_heads, head_dim=model_config.head_dim,
        block_size=engine_config.block_size, revision=revision, cache_salt=engine_config.cache_salt,
        hash_algo=engine_config.hash_algo,
    )


def weights_revision(model_config: ModelConfig, *, seed: int = 0, model_dir: str | Path | None = None) -> str:
    """Revision string of seeded weights or of a safetensors directory (see :mod:`.weights`)."""
    if model_dir is not None:
        return file_revision(model_dir, model_config.dtype)
    return seeded_revision(model_config, seed)
