"""``store_kvcache``: write a step's new K/V rows into the paged buffer at slot-mapped positions.

``slot = block_id * block_size + offset``; a slot of -1 means "do not store". Per layer the
caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` and the new rows
``[num_tokens, num_kv_heads, head_dim]``. Two implementations give the same bytes: a Triton
kernel (used on CUDA, or on CPU when ``TRITON_INTERPRET=1``) and a torch fallback.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable

import torch

from tiered_kv.dtypes import byte_view

logger = logging.getLogger(__name__)

StoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def store_kvcache_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Fallback: ``index_copy_`` of the rows into the flattened ``[slots, heads, dim]`` caches."""
    if slot_mapping.numel() == 0:
        return
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    heads, dim = k_cache.shape[-2:]
    k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


@functools.lru_cache(maxsize=1)
def _triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def store_rows(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                   key_stride, value_stride, row_size, ROW_BLOCK: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)  # token * stride passes 2**31 in a long step
        part = tl.program_id(1)
        slot = tl.load(slot_ptr + token)
        if slot >= 0:
            cols = part * ROW_BLOCK + tl.arange(0, ROW_BLOCK)
            inside = cols < row_size
            k_row = tl.load(key_ptr + token * key_stride + cols, mask=inside)
            v_row = tl.load(value_ptr + token * value_stride + cols, mask=inside)
            dest = slot.to(tl.int64) * row_size + cols
            tl.store(k_cache_ptr + dest, k_row, mask=inside)
            tl.store(v_cache_ptr + dest, v_row, mask=inside)

    return triton, store_rows


def store_kvcache_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton kernel: one program per (token, slice of the heads*dim row)."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    triton, kernel = _triton_kernel()
    heads, dim = k_cache.shape[-2:]
    row_size = heads * dim
    key = key.reshape(num_tokens, row_size).to(k_cache.dtype)
    value = value.reshape(num_tokens, row_size).to(v_cache.dtype)
    if key.stride(1) != 1:
        key = key.contiguous()
    if value.stride(1) != 1:
        value = value.contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kvcache_triton needs contiguous per-layer caches")
    row_block = min(triton.next_power_of_2(row_size), 1024)
    grid = (num_tokens, triton.cdiv(row_size, row_block))
    # it launches on the current CUDA device, not on the caches'; and it only moves elements, so
    # fp8 goes as bytes (Triton refuses fp8 types on GPUs before sm_89)
    guard = torch.cuda.device(k_cache.device) if k_cache.is_cuda else contextlib.nullcontext()
    with guard:
        kernel[grid](byte_view(key), byte_view(value), byte_view(k_cache), byte_view(v_cache), slot_mapping.contiguous(),
                     key.stride(0), value.stride(0), row_size, ROW_BLOCK=row_block)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install
        return False
    return True


def select_store_kvcache(kind: str, device: torch.device) -> StoreFn:
    """``kind``: "triton", "torch" or "auto" (Triton on CUDA or under TRITON_INTERPRET=1)."""
    if kind == "torch":
        return store_kvcache_torch
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if kind == "triton":
        if not triton_available():
            raise RuntimeError("kv_kernel='triton' but triton cannot be imported")
        if device.type != "cuda" and not interpret:
            raise RuntimeError("kv_kernel='triton' needs CUDA tensors or TRITON_INTERPRET=1")
        return store_kvcache_triton
    if (device.type == "cuda" or interpret) and triton_available():
        return store_kvcache_triton
    return store_kvcache_torch
