"""Rotary position embedding (Llama / Hugging Face ``rotate_half`` convention)."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """A cos/sin table for positions ``[0, max_position)``, kept in fp32 whatever the model dtype
    (plain tensors, not buffers, so ``model.to(dtype)`` leaves them alone)."""

    def __init__(self, head_dim: int, max_position: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
        angles = torch.arange(max_position, dtype=torch.float64, device="cpu")[:, None] * inv_freq[None, :]
        self._tables = {torch.device("cpu"): (angles.cos().float(), angles.sin().float())}

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows of ``positions``, shaped ``[T, 1, D/2]`` to broadcast over heads."""
        device = positions.device
        if device not in self._tables:
            cos, sin = self._tables[torch.device("cpu")]
            self._tables[device] = (cos.to(device), sin.to(device))
        cos, sin = self._tables[device]
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[T, heads, D]`` by the tables from :meth:`RotaryEmbedding.tables`."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
