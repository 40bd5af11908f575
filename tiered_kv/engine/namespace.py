"""The namespace of the engine's KV blocks: model shape, dtype, block size, weights revision and,
for MLA and hybrid models, their KV cache groups."""

from __future__ import annotations

from pathlib import Path

from tiered_kv.engine.config import EngineConfig, ModelConfig
from tiered_kv.engine.weights import file_revision, seeded_revision
from tiered_kv.keys import Namespace
from tiered_kv.kv_groups import KVGroup


def kv_groups(model_config: ModelConfig, engine_config: EngineConfig) -> tuple[KVGroup, ...]:
    """The KV cache groups of the model's cache (what the engine's cached-sequence interface
    manages): () for a Llama (the classic namespace, its digest unchanged); one ``mla`` group of
    ``[c_kv, k_rope]`` vectors per token; a hybrid's ``full`` group of its attention layers and
    ``state`` group of its Mamba2 layers, a layer's state per sequence being its conv state
    ``[conv_dim, K-1]`` followed by its SSM state ``[heads, head_dim, d_state]``, flattened."""
    bs, dtype = engine_config.block_size, model_config.dtype
    if model_config.kind == "mla":
        return (KVGroup("mla", model_config.num_layers, (model_config.mla_latent_dim,), dtype, bs),)
    if model_config.kind == "hybrid":
        c = model_config
        state_elems = c.mamba_conv_dim * (c.conv_kernel - 1) + c.mamba_num_heads * c.mamba_head_dim * c.ssm_state_size
        return (KVGroup("full", len(c.attention_layer_ids), (2, c.num_kv_heads, c.head_dim), dtype, bs),
                KVGroup("state", len(c.mamba_layer_ids), (state_elems,), dtype, bs))
    return ()


def engine_namespace(model_config: ModelConfig, engine_config: EngineConfig, revision: str) -> Namespace:
    """The namespace of this engine's KV blocks (what a connector must use for its keys).

    MLA: one group, ``num_kv_heads`` 1 and ``head_dim`` the latent width, TP rank 0 of 1 (the
    latent is the same on every rank: stored once). Hybrid: ``num_layers`` counts attention layers.
    """
    groups = kv_groups(model_config, engine_config)
    num_layers, heads, head_dim = model_config.num_layers, model_config.num_kv_heads, model_config.head_dim
    if model_config.kind == "mla":
        heads, head_dim = 1, model_config.mla_latent_dim
    elif model_config.kind == "hybrid":
        num_layers = len(model_config.attention_layer_ids)
    return Namespace(
        model_id=engine_config.model_id, dtype=model_config.dtype, num_layers=num_layers,
        num_kv_heads=heads, head_dim=head_dim,
        block_size=engine_config.block_size, revision=revision, cache_salt=engine_config.cache_salt,
        hash_algo=engine_config.hash_algo, groups=groups,
    )


def weights_revision(model_config: ModelConfig, *, seed: int = 0, model_dir: str | Path | None = None) -> str:
    """Revision string of seeded weights or of a safetensors directory (see :mod:`.weights`)."""
    if model_dir is not None:
        return file_revision(model_dir, model_config.dtype)
    return seeded_revision(model_config, seed)
