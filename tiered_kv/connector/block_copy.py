"""Block copies between the engine's ``[2, L, blocks, C]`` KV buffer and canonical blocks.

The canonical payload of block ``b`` is ``[L, 2, C]`` (``C = block_size * heads * head_dim``).
In torch a gather is ``index_select`` (one pass) then ``permute(...).contiguous()`` (a second);
the Triton kernel moves each ``C``-element chunk straight from its place in the engine buffer
to its place in the output in one pass, and the scatter does the reverse. The Triton path is
used on CUDA when Triton is importable (or on CPU under ``TRITON_INTERPRET=1``, for tests); the
torch path everywhere else. Both give the same bytes.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from tiered_kv.dtypes import byte_view

TILE = 1024  # elements per program along a chunk


def gather_torch(kv: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[n, L, 2, ...]`` copy of blocks ``ids`` of ``kv`` ``[2, L, blocks, ...]``."""
    return kv.index_select(2, ids).transpose(0, 2).contiguous()


def scatter_torch(kv: torch.Tensor, ids: torch.Tensor, src: torch.Tensor) -> None:
    """Write ``src`` ``[n, L, 2, ...]`` into blocks ``ids`` of ``kv``."""
    kv.index_copy_(2, ids, src.to(kv.dtype).transpose(0, 2))


@functools.lru_cache(maxsize=1)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_chunks(engine_ptr, blocks_ptr, ids_ptr, num_layers, num_blocks, chunk,
                    TO_BLOCKS: tl.constexpr, TILE: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)  # over n * L * 2 chunks, in canonical order
        tile = tl.program_id(1)
        i = pid // (num_layers * 2)
        layer = (pid // 2) % num_layers
        kv = pid % 2
        block = tl.load(ids_ptr + i).to(tl.int64)
        cols = tile * TILE + tl.arange(0, TILE)
        inside = cols < chunk
        engine_off = ((kv * num_layers + layer) * num_blocks + block) * chunk + cols
        blocks_off = pid * chunk + cols
        if TO_BLOCKS:
            tl.store(blocks_ptr + blocks_off, tl.load(engine_ptr + engine_off, mask=inside), mask=inside)
        else:
            tl.store(engine_ptr + engine_off, tl.load(blocks_ptr + blocks_off, mask=inside), mask=inside)

    return triton, copy_chunks


def on_device(device: torch.device):
    """The device a Triton kernel launches on: it launches on the *current* CUDA device, not on
    its tensors' (a pool on another GPU was read and written at the current one's addresses)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _launch(kv: torch.Tensor, ids: torch.Tensor, blocks: torch.Tensor, to_blocks: bool) -> None:
    triton, kernel = _kernels()
    ids = ids.contiguous()  # the kernel reads id i at ids_ptr + i (a column of a group's rows is strided)
    _, num_layers, num_blocks = kv.shape[:3]
    chunk = kv[0, 0, 0].numel()
    grid = (ids.numel() * num_layers * 2, triton.cdiv(chunk, TILE))
    with on_device(kv.device):
        kernel[grid](byte_view(kv), byte_view(blocks), ids, num_layers, num_blocks, chunk,
                     TO_BLOCKS=to_blocks, TILE=TILE)


def gather_triton(kv: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    out = torch.empty((ids.numel(), kv.shape[1], 2, *kv.shape[3:]), dtype=kv.dtype, device=kv.device)
    if ids.numel():
        _launch(kv, ids.to(kv.device), out, True)
    return out


def scatter_triton(kv: torch.Tensor, ids: torch.Tensor, src: torch.Tensor) -> None:
    if ids.numel():
        _launch(kv, ids.to(kv.device), src.to(kv.dtype).contiguous(), False)


def use_triton(device: torch.device) -> bool:
    """Triton on CUDA (or anywhere under TRITON_INTERPRET=1) when it imports."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        _kernels()
    except Exception:  # not installed, or no driver for this device
        return False
    return True
