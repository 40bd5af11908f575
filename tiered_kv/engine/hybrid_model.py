"""A hybrid decoder: Mamba2 layers and Llama-style attention layers in one stack.

``ModelConfig.layer_pattern`` names each layer: ``"M"`` a Mamba2 block (RMSNorm, then the
:class:`~.mamba.Mamba2Mixer` on the residual stream), ``"*"`` a Llama decoder layer (attention and
SwiGLU MLP). Attention layers page K/V per token; Mamba2 layers keep a conv state and an SSM state
per sequence. Parameter names: ``model.layers.{i}.mixer.*`` and ``model.layers.{i}.self_attn.*``.
"""

from __future__ import annotations

import torch
from torch import nn

from tiered_kv.engine.attention import AttentionMetadata
from tiered_kv.engine.config import ModelConfig
from tiered_kv.engine.mamba import Mamba2Mixer
from tiered_kv.engine.model import DecoderLayer, LlamaForCausalLM, RMSNorm
from tiered_kv.engine.rotary import RotaryEmbedding


class MambaBlock(nn.Module):
    def __init__(self, config: ModelConfig, mamba_idx: int) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.mixer = Mamba2Mixer(mamba_idx, config.hidden_size, config.mamba_num_heads, config.mamba_head_dim,
                                 config.ssm_state_size, config.mamba_n_groups, config.conv_kernel,
                                 config.rms_eps, config.dtype)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata | None) -> torch.Tensor:
        return hidden + self.mixer(self.norm(hidden), meta)


class HybridModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layers: list[nn.Module] = []
        for char in config.layer_pattern:
            if char == "M":
                layers.append(MambaBlock(config, sum(isinstance(m, MambaBlock) for m in layers)))
            else:
                layers.append(DecoderLayer(config, sum(isinstance(m, DecoderLayer) for m in layers)))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position, config.rope_theta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary.tables(positions)
        for layer in self.layers:
            hidden = layer(hidden, meta) if isinstance(layer, MambaBlock) else layer(hidden, cos, sin, meta)
        return self.norm(hidden)

    @property
    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.layers if isinstance(layer, DecoderLayer)]

    @property
    def mamba_layers(self) -> list[Mamba2Mixer]:
        return [layer.mixer for layer in self.layers if isinstance(layer, MambaBlock)]


class HybridForCausalLM(LlamaForCausalLM):
    """Mamba2 + attention; ``forward_dense`` runs every Mamba2 layer from zero states token by token."""

    backbone = HybridModel
