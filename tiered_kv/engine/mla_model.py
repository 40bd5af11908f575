"""A decoder with multi-head latent attention (DeepSeek-style) and a SwiGLU MLP per layer.

Every layer caches one vector per token (:mod:`.mla`); parameter names follow DeepSeek's
(``model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight``, ``...kv_b_proj.weight``, ...).
"""

from __future__ import annotations

from torch import nn

from tiered_kv.engine.config import ModelConfig
from tiered_kv.engine.mla import MLAttention
from tiered_kv.engine.model import DecoderLayer, LlamaForCausalLM, LlamaModel


class MLAModel(LlamaModel):
    """The Llama stack with latent attention in every layer; RoPE covers the rotary part only."""

    @staticmethod
    def make_layer(config: ModelConfig, layer_idx: int) -> nn.Module:
        attention = MLAttention(layer_idx, config.hidden_size, config.num_heads, config.kv_lora_rank,
                                config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim,
                                config.rms_eps, config.dtype)
        return DecoderLayer(config, layer_idx, attention)

    @staticmethod
    def rope_dim(config: ModelConfig) -> int:
        return config.qk_rope_head_dim


class MLAForCausalLM(LlamaForCausalLM):
    """MLA model; ``forward_dense`` attends over latents that never went through a cache."""

    backbone = MLAModel
