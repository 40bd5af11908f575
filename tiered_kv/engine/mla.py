"""Multi-head latent attention (DeepSeek-style), caching one vector per token per layer.

Per token ``kv_a_proj_with_mqa`` gives a compressed latent ``c_kv`` (``kv_lora_rank``) and a key
part ``k_rope`` (``qk_rope_head_dim``) shared by every head. The cache keeps
``[rmsnorm(c_kv), rope(k_rope)]`` (:class:`~.cache_resources.LatentHandler`), in the engine's
blocks like K/V (``[num_blocks, block_size, latent_dim]``). Attention rebuilds each head's key
(``k_nope`` from ``kv_b_proj(c_kv)``, then ``k_rope``) and value (from ``kv_b_proj(c_kv)``) from
the cached vectors, so every cached value reaches the output; a decode step absorbs
``kv_b_proj`` into its queries and output instead and attends over the cached vectors directly
(the same math, rounded otherwise). Prompt tokens are always computed the first way, also in a
chunk that resumes a loaded prefix: in bf16 the absorbed path's rounding flips greedy tokens, and
a restored prompt must give the tokens of the same prompt computed from token 0. The vector is the
same on every tensor-parallel rank (heads split ``kv_b_proj``, not the latent): stored once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tiered_kv.engine.cache_resources import LatentHandler, ResourceHandler
from tiered_kv.engine.model import RMSNorm
from tiered_kv.engine.rotary import apply_rotary


def store_latent(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``rows`` [T, D] at ``slot_mapping`` (``block * block_size + offset``; -1 = skip)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        rows, slot_mapping = rows[keep], slot_mapping[keep]
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, rows.to(cache.dtype))


class MLAttention(nn.Module):
    def __init__(self, layer_idx: int, hidden_size: int, num_heads: int, kv_lora_rank: int, rope_dim: int,
                 nope_dim: int, v_dim: int, eps: float, dtype: str) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.rank, self.rope, self.nope, self.v_dim = num_heads, kv_lora_rank, rope_dim, nope_dim, v_dim
        self.dtype_name = dtype
        self.scale = (nope_dim + rope_dim) ** -0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * (nope_dim + rope_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (nope_dim + v_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_dim, hidden_size, bias=False)
        self.latent_cache: torch.Tensor | None = None  # [num_blocks, block_size, latent_dim]

    def cache_resources(self) -> dict[str, ResourceHandler]:
        return {"latent_cache": LatentHandler(self.dtype_name, latent_dim=self.rank + self.rope)}

    def bind_cache(self, name: str, view: torch.Tensor) -> None:
        setattr(self, name, view)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta) -> torch.Tensor:
        tokens = hidden.shape[0]
        q = self.q_proj(hidden).view(tokens, self.num_heads, self.nope + self.rope)
        q = torch.cat([q[..., :self.nope], apply_rotary(q[..., self.nope:], cos, sin)], dim=-1)
        c_kv, k_rope = self.kv_a_proj_with_mqa(hidden).split([self.rank, self.rope], dim=-1)
        k_rope = apply_rotary(k_rope.unsqueeze(1), cos, sin).squeeze(1)
        latent = torch.cat([self.kv_a_layernorm(c_kv), k_rope], dim=-1)  # [T, D]: what is cached
        if meta is None:
            out = self._attend(q, latent, past=0)
        else:
            if self.latent_cache is None:
                raise RuntimeError("MLA step before bind_cache()")
            hooks = meta.hooks
            if hooks is not None:
                hooks.wait_for_layer_load(self.layer_idx)
            store_latent(latent, self.latent_cache, meta.slot_mapping)
            out = torch.empty(tokens, self.num_heads, self.v_dim, dtype=hidden.dtype, device=hidden.device)
            starts = meta.query_starts
            for i, block_table in enumerate(meta.block_tables):
                first, last = starts[i], starts[i + 1]
                context = meta.context_lens[i]
                cached = self.latent_cache[block_table].flatten(0, 1)[:context]
                past = context - (last - first)
                # absorbed only for decodes: a prompt chunk's path must not depend on where its
                # context came from (computed in this run or loaded from a store)
                decoding = i < len(meta.decoding) and meta.decoding[i]
                attend = self._attend_absorbed if past and decoding else self._attend
                out[first:last] = attend(q[first:last], cached, past=past)
            if hooks is not None:
                hooks.save_kv_layer(self.layer_idx)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.v_dim))

    def _attend_absorbed(self, q: torch.Tensor, latent: torch.Tensor, past: int) -> torch.Tensor:
        """The same attention with ``kv_b_proj`` absorbed into the query and the output: the
        queries attend over the cached vectors themselves (one shared "head"), so a few new tokens
        over a long cached context never rebuild K and V for all of it (decode, resumed prefill)."""
        n, context = q.shape[0], latent.shape[0]
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        q_latent = torch.einsum("nhd,hdr->nhr", q[..., :self.nope], w[:, :self.nope])
        qh = torch.cat([q_latent, q[..., self.nope:]], dim=-1).transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        kh = latent[None, None]  # [1, 1, context, D]
        vh = F.pad(latent[..., :self.rank], (0, self.rope))[None, None]  # c_kv, as wide as the keys
        if n == 1:
            o = F.scaled_dot_product_attention(qh, kh, vh, scale=self.scale, enable_gqa=True)
        else:
            rows = torch.arange(past, past + n, device=q.device)[:, None]
            mask = torch.arange(context, device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return torch.einsum("nhr,hvr->nhv", o[0, :, :, :self.rank].transpose(0, 1), w[:, self.nope:])

    def _attend(self, q: torch.Tensor, latent: torch.Tensor, past: int) -> torch.Tensor:
        """``q`` [n, H, nope+rope] at positions past..past+n-1 over the cached ``latent`` [past+n, D]."""
        n, context = q.shape[0], latent.shape[0]
        c_kv, k_rope = latent.split([self.rank, self.rope], dim=-1)
        kv = self.kv_b_proj(c_kv).view(context, self.num_heads, self.nope + self.v_dim)
        k = torch.cat([kv[..., :self.nope], k_rope[:, None, :].expand(context, self.num_heads, self.rope)], -1)
        v = kv[..., self.nope:]
        if self.v_dim < q.shape[-1]:  # values as wide as the keys: SDPA's fused kernels need that on CPU
            v = F.pad(v, (0, q.shape[-1] - self.v_dim))
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if past == 0 and n > 1:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale)
        elif n == 1 or past == 0:
            o = F.scaled_dot_product_attention(qh, kh, vh, scale=self.scale)
        else:
            rows = torch.arange(past, past + n, device=q.device)[:, None]
            mask = torch.arange(context, device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale)
        return o[0].transpose(0, 1)[..., :self.v_dim]
