"""Bit-level comparison of KV tensors (compared as integers of their element size: bf16/fp16 as
16-bit patterns, byte-typed fp8 pools byte for byte)."""

from __future__ import annotations

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    if len(got) != len(want):
        return False
    return all(
        g.shape == w.shape and g.dtype == w.dtype
        and torch.equal(g.view(_BITS[g.element_size()]), w.view(_BITS[w.element_size()]))
        for g, w in zip(got, want)
    )


def first_tokens(kv: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    return [t[:n] for t in kv]
