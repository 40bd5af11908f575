"""The host tier's memory: one slab of fixed-size slots, page-locked when CUDA is present,
every page touched when it is made (not in the hot path) and handed back when the tier closes."""

from __future__ import annotations

import torch

from tiered_kv.units import as_bool


def want_pinned(pinned: str | bool) -> bool:
    """Page-locked memory: "auto" (when CUDA is there) or a bool setting (only with CUDA)."""
    if isinstance(pinned, str) and pinned.strip().lower() == "auto":
        return torch.cuda.is_available()
    return as_bool(pinned, "host pinned (auto, or true / false)") and torch.cuda.is_available()


def new_slab(num_slots: int, slot_bytes: int, pinned: bool) -> torch.Tensor:
    """``[num_slots, slot_bytes]`` uint8, every page touched now."""
    slab = torch.empty((num_slots, slot_bytes), dtype=torch.uint8, pin_memory=pinned)
    slab.zero_()
    return slab


def no_slab(slot_bytes: int) -> torch.Tensor:
    """What a closed tier holds instead of its slab: no slots, and no view of the old memory
    (a view would keep all of it)."""
    return torch.empty((0, slot_bytes), dtype=torch.uint8)
