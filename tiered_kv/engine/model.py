"""A Llama-style decoder: embeddings, RMSNorm, RoPE, GQA attention, SwiGLU MLP, final norm, LM head.

The model defines parameters and the forward only: seeding, loading and saving them is :mod:`tiered_kv.engine.weights`, which imports this module
(never the reverse). Parameter names follow Hugging Face's ``LlamaForCausalLM``
(``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``, ...), so those files are HF safetensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tiered_kv.engine.attention import Attention, AttentionMetadata
from tiered_kv.engine.config import ModelConfig
from tiered_kv.engine.rotary import RotaryEmbedding

__all__ = ["LlamaForCausalLM", "ModelConfig"]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Attention (GQA unless another is handed in, e.g. MLA) and a SwiGLU MLP, pre-norm."""

    def __init__(self, config: ModelConfig, layer_idx: int, attention: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = attention if attention is not None else Attention(
            layer_idx, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, config.dtype)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata | None) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    """The decoder stack without the LM head; backbones of other kinds follow its interface."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.rotary = RotaryEmbedding(self.rope_dim(config), config.max_position, config.rope_theta)

    @staticmethod
    def make_layer(config: ModelConfig, layer_idx: int) -> nn.Module:
        return DecoderLayer(config, layer_idx)

    @staticmethod
    def rope_dim(config: ModelConfig) -> int:
        return config.head_dim

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


class LlamaForCausalLM(nn.Module):
    """The whole model. ``forward`` runs one paged step; ``forward_dense`` is the cache-free reference.

    Other kinds of model (:mod:`.hybrid_model`, :mod:`.mla_model`) subclass it with another
    ``backbone`` (the stack under ``model.``); embeddings, LM head and references are shared.
    """

    backbone: type[nn.Module] = LlamaModel

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def attention_layers(self) -> list[nn.Module]:
        """The layers that page per-token KV, in their KV buffer order."""
        return self.model.attention_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | None = None) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of a step (``meta`` = paged; None = dense causal)."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.inference_mode()
    def forward_dense(self, tokens: list[int] | torch.Tensor) -> torch.Tensor:
        """Logits ``[T, vocab]`` of every position with full causal attention and no KV cache."""
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(ids.numel(), device=self.device)
        return self.compute_logits(self.model(ids, positions, None))

