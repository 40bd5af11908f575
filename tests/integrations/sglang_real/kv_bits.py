"""Bit-level comparison of KV tensors (bf16/fp16: compared as their 16-bit patterns)."""

from __future__ import annotations

import torch


def same_bits(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    if len(got) != len(want):
        return False
    return all(
        g.shape == w.shape and g.dtype == w.dtype and torch.equal(g.view(torch.int16), w.view(torch.int16))
        for g, w in zip(got, want)
    )


def first_tokens(kv: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    return [t[:n] for t in kv]
