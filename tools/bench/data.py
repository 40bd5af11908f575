"""The KV block data bench_tiers moves: the two block sizes (2 MiB Llama-8B-like blocks and the
64 KiB single-layer cuts of them), bf16 blocks drawn like real KV (per-channel means and scales,
a few outlier channels), the namespaces and block keys they are stored under, and a uint8 numpy
view of a block's bytes."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tiered_kv.keys import Namespace, block_keys

from .figures import torch_threads

# name -> (namespace fields, batch of blocks per save/load call)
SIZES: dict[str, dict[str, Any]] = {
    "2MiB": {"num_layers": 32, "batch": 32},
    "64KiB": {"num_layers": 1, "batch": 256},
}
KV = {"num_kv_heads": 8, "head_dim": 128, "block_size": 16, "dtype": "bfloat16"}


def kv_like_blocks(n: int, shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    """bf16 blocks drawn like real KV: every (layer, K/V, head, channel) has its own mean and
    log-normal scale, and ~3 channels per head are outliers (20x mean and scale)."""
    g = torch.Generator().manual_seed(seed)
    stat = (shape[0], shape[1], 1, shape[3], shape[4])
    mean = torch.randn(stat, generator=g) * 0.5
    scale = torch.exp(torch.randn(stat, generator=g) * 0.5)
    outlier = torch.rand(stat, generator=g) < 3 / shape[4]
    mean = torch.where(outlier, mean * 20, mean)
    scale = torch.where(outlier, scale * 20, scale)
    with torch_threads(1):
        return [(torch.randn(shape, generator=g) * scale + mean).to(torch.bfloat16) for _ in range(n)]


def namespace(size: str, tag: str) -> Namespace:
    return Namespace(model_id=f"bench-tiers/llama-8b-like/{tag}", num_layers=SIZES[size]["num_layers"],
                     **KV)


def shape_of(size: str) -> tuple[int, ...]:
    return (SIZES[size]["num_layers"], 2, KV["block_size"], KV["num_kv_heads"], KV["head_dim"])


def keys_of(ns: Namespace, n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 128_000, size=n * ns.block_size).tolist()
    return block_keys(ns, tokens)


def touched(shape: tuple[int, ...], dtype: torch.dtype = torch.uint8, value: int = 1) -> torch.Tensor:
    """A new CPU tensor with every byte set to ``value`` (every page touched), filled by NumPy on
    this thread. Not by torch's ``fill_``: that runs on torch's OpenMP threads, which then spin
    for a few milliseconds waiting for more work, on the cores the next timed phase needs."""
    t = torch.empty(shape, dtype=dtype)
    t.view(torch.uint8).numpy().fill(value)
    return t


def as_np(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a contiguous CPU tensor's bytes."""
    return t.reshape(-1).view(torch.uint8).numpy()
