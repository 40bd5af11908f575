"""How a block looks: its canonical shape and dtype, host slots as tensors, tensors as bytes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from storage_backends.host import HostBackend
from tiered_kv.errors import ConfigError
from tiered_kv.store.host_copy import HostCopier
from tiered_kv.keys import Namespace


def block_shape(ns: Namespace) -> tuple[int, int, int, int, int]:
    """Canonical payload shape ``[num_layers, 2, block_size, num_kv_heads, head_dim]``."""
    return (ns.num_layers, 2, ns.block_size, ns.num_kv_heads, ns.head_dim)


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"torch has no dtype {name!r}")
    return dtype


def bytes_of(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a flat uint8 array (shares memory)."""
    return t.view(torch.uint8).numpy().reshape(-1)


class SlotViews:
    """Host slots of a :class:`tiered_kv.store.TieredStore` as block tensors (a mixin: the
    store sets the attributes below)."""

    host: HostBackend
    shape: tuple[int, int, int, int, int]
    dtype: torch.dtype
    block_nbytes: int
    _slot_views: list[torch.Tensor | None]
    _slot_rows: np.ndarray
    copier: HostCopier

    def slot_tensor(self, slot: int) -> torch.Tensor:
        """Host slot ``slot`` as a canonical block tensor (shares memory with the slab)."""
        view = self._slot_views[slot]
        if view is None:  # made once per slot: the three tensor ops cost ~13 us a block
            view = self._slot_views[slot] = (
                self.host.slot_view(slot, self.block_nbytes).view(self.dtype).view(self.shape))
        return view

    def _plain(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a whole contiguous CPU block of our dtype and shape: copied to and from
        host slots with one memcpy on the calling thread. torch's CPU ``copy_`` splits every block
        over its OpenMP pool, and when another thread holds a core (the transfer pool compressing,
        the engine, a neighbour process) each block waits for a scheduler tick: host copies ran at
        0.2-0.5 GB/s that way against ~6 GB/s for one memcpy (tools/bench_tiers.py, 2 cores)."""
        return (t.device.type == "cpu" and t.dtype == self.dtype and t.shape == self.shape
                and t.is_contiguous() and not t.requires_grad)

    def copy_blocks(self, slots: Sequence[int], blocks: Sequence[torch.Tensor], *, into_slots: bool) -> None:
        """Copy canonical block tensors into (or out of) host ``slots``: plain CPU blocks as one
        batch of memcpys (spread over the copier's threads when large), others through torch."""
        plain = []
        for slot, block in zip(slots, blocks):
            if self._plain(block):
                row, mem = self._slot_rows[slot], bytes_of(block)
                plain.append((row, mem) if into_slots else (mem, row))
            elif into_slots:
                self.slot_tensor(slot).copy_(block)
            else:
                block.copy_(self.slot_tensor(slot))
        self.copier.copy(plain)
