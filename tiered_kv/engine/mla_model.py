"""A decoder with multi-head latent attention (DeepSeek-style) and a SwiGLU MLP per layer.

Every layer caches one vector per token (:mod:`.mla`); parameter names follow DeepSeek's
(``model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight``, ``...kv_b_proj.weight``, ...).
"""

from __future__ import annotations

import torch
from torch import nn

from tiered_kv.engine.attention import AttentionMetadata
from tiered_kv.engine.config import ModelConfig
from tiered_kv.engine.mla import MLAttention
from tiered_kv.engine.model import MLP, LlamaForCausalLM, RMSNorm
from tiered_kv.engine.rotary import RotaryEmbedding


class MLADecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MLAttention(layer_idx, config.hidden_size, config.num_heads, config.kv_lora_rank,
                                     config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim,
                                     config.rms_eps, config.dtype)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata | None) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class MLAModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MLADecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.rotary = RotaryEmbedding(config.qk_rope_head_dim, config.max_position, config.rope_theta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary.tables(positions)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, meta)
        return self.norm(hidden)

    @property
    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.layers]


class MLAForCausalLM(LlamaForCausalLM):
    """MLA model; ``forward_dense`` attends over latents that never went through a cache."""

    backbone = MLAModel
