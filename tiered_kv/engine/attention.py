"""GQA self-attention over the paged KV buffer (and a dense path without any cache).

One step's tokens of several requests are concatenated (``[T, ...]``). Each layer stores the new
K/V rows into its view of the paged buffer, then every request's queries attend to all of its
cached tokens (prefix blocks + this chunk, causal within the chunk) gathered from its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tiered_kv.engine.cache_resources import PagedKVHandler, ResourceHandler
from tiered_kv.engine.kv_kernel import StoreFn, store_kvcache_torch
from tiered_kv.engine.rotary import apply_rotary


@dataclass
class AttentionMetadata:
    """Where one step's tokens go in the paged buffer and what each request attends to."""

    slot_mapping: torch.Tensor  # [T] long: block_id * block_size + offset of every new token
    query_starts: list[int]  # request i's tokens are rows query_starts[i]:query_starts[i+1]
    context_lens: list[int]  # tokens in request i's cache after this step's write
    block_tables: list[torch.Tensor]  # request i's device block ids (long, on the device)
    hooks: object | None = None  # connector worker half: wait_for_layer_load / save_kv_layer
    state_slots: list[int] = field(default_factory=list)  # request i's state slot (models with state)
    decoding: list[bool] = field(default_factory=list)  # request i computes generated tokens only (no prompt token)


class Attention(nn.Module):
    def __init__(self, layer_idx: int, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, dtype: str = "float32") -> None:
        super().__init__()
        self.layer_idx = layer_idx  # index among the model's attention layers (its KV buffer row)
        self.dtype_name = dtype
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.store_kvcache: StoreFn = store_kvcache_torch

    def cache_resources(self) -> dict[str, ResourceHandler]:
        return {"kv_cache": PagedKVHandler(self.dtype_name, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)}

    def bind_cache(self, name: str, view: torch.Tensor) -> None:
        """``view``: this layer's ``[2, num_blocks, block_size, H, D]`` view of the buffer."""
        self.k_cache, self.v_cache = view[0], view[1]

    def bind_kv_cache(self, layer_kv: torch.Tensor, store_fn: StoreFn) -> None:
        self.bind_cache("kv_cache", layer_kv)
        self.store_kvcache = store_fn

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata | None) -> torch.Tensor:
        tokens = hidden.shape[0]
        q = self.q_proj(hidden).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if meta is None:
            out = self._attend(q, k, v, past=0)
        else:
            out = self._paged(q, k, v, meta)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))

    def _paged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("paged attention before bind_kv_cache()")
        hooks = meta.hooks
        if hooks is not None:
            hooks.wait_for_layer_load(self.layer_idx)
        self.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        starts = meta.query_starts
        for i, block_table in enumerate(meta.block_tables):
            first, last = starts[i], starts[i + 1]
            context = meta.context_lens[i]
            keys = self.k_cache[block_table].flatten(0, 1)[:context]
            values = self.v_cache[block_table].flatten(0, 1)[:context]
            out[first:last] = self._attend(q[first:last], keys, values, past=context - (last - first))
        if hooks is not None:
            hooks.save_kv_layer(self.layer_idx)
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
        """``q`` [n, Hq, D] at positions past..past+n-1 over ``k``/``v`` [past+n, Hkv, D].

        SDPA gets 4-D ``[1, heads, tokens, D]`` inputs: 3-D ones fall back to a far slower path on CPU.
        """
        n, context = q.shape[0], k.shape[0]
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if past == 0:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=n > 1, scale=self.scale, enable_gqa=True)
        elif n == 1:
            o = F.scaled_dot_product_attention(qh, kh, vh, scale=self.scale, enable_gqa=True)
        else:
            rows = torch.arange(past, past + n, device=q.device)[:, None]
            mask = torch.arange(context, device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o[0].transpose(0, 1)
