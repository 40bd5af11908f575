"""The engine's tensors of a namespace with KV groups, packed into stored entries and back.

Each group has its own part layout (:mod:`tiered_kv.kv_groups` gives the part shapes):

- ``full`` / ``sliding`` / ``chunked``: K and V per token, through the same layouts as a model
  with one group (:func:`tiered_kv.connector.layout.make_layout` over the group's tensors);
- ``mla``: one latent per token, per-layer ``[blocks, block_size, D]`` tensors or one
  ``[L, blocks, block_size, D]`` buffer;
- ``state``: a recurrent layer's state per sequence slot, per-layer ``[slots, ...]`` tensors
  (vLLM: ``int8`` rows ``[blocks, 1, 1, state bytes]``, strided over padded pages) or one ``[L, slots, ...]`` buffer.

A block entry is gathered from a row of block ids (one per token group); an id of ``-1`` means
the engine keeps no block of that group there (vLLM's null block for a sliding window's old
blocks): nothing is written to it on a load, and saves never plan such a row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from math import prod

import torch

from tiered_kv.connector.layout import BYTE_CONTAINERS, KVLayout, as_engine_dtype, make_layout
from tiered_kv.dtypes import torch_dtype
from tiered_kv.errors import ConfigError
from tiered_kv.keys import Namespace
from tiered_kv.kv_groups import KVGroup, state_groups, token_groups


def _layers(kv, group: KVGroup, what: str) -> list[torch.Tensor]:
    """The group's tensors as one tensor per layer (a stacked buffer is split on dim 0)."""
    if isinstance(kv, Mapping):
        kv = list(kv.values())
    layers = list(kv.unbind(0)) if isinstance(kv, torch.Tensor) else list(kv)
    if len(layers) != group.num_layers:
        raise ConfigError(f"{what}: got {len(layers)} layer tensors, the group has {group.num_layers} layers")
    if any(not isinstance(t, torch.Tensor) for t in layers):
        raise ConfigError(f"{what}: expected tensors")
    return layers


def as_row_dtype(engine: torch.dtype, group: torch.dtype) -> torch.dtype:
    """The dtype a part's rows are copied in: the group's, or the engine's bytes for fp8 kept in bytes."""
    return engine if engine in BYTE_CONTAINERS and str(group).startswith("torch.float8") else group


class _RowsPart:
    """A part whose rows are ``[blocks, ...]`` per layer (MLA latents, state slots)."""

    def __init__(self, group: KVGroup, layers: list[torch.Tensor], per_row: int, what: str) -> None:
        self.group = group
        dtype = torch_dtype(group.dtype)
        for t in layers:
            byte_fp8 = group.dtype.startswith("float8") and t.dtype in (torch.uint8, torch.int8)
            if t.dtype.itemsize != dtype.itemsize or (t.dtype.is_floating_point != dtype.is_floating_point
                                                       and not byte_fp8):
                raise ConfigError(f"{what}: tensors are {t.dtype}, the group says {group.dtype}")
            if t.dim() < 2 or prod(t.shape[1:]) != per_row or not t[0].is_contiguous():
                raise ConfigError(f"{what}: tensor {tuple(t.shape)} is not rows of {per_row} contiguous "
                                  f"{group.dtype} values")
            if t.shape[0] > 1 and t.stride(0) < per_row:  # an expanded or odd view: a row's copy
                # would read and write its neighbours' values
                raise ConfigError(f"{what}: tensor {tuple(t.shape)} has rows {t.stride(0)} values apart, "
                                  f"less than a row of {per_row}: its rows overlap")
        # rows may be strided (vLLM's Mamba rows view the start of each padded page); fp8 kept in
        # bytes stays bytes (CPU torch has no index_copy_ for fp8: every load of it failed)
        self.rows = [t.as_strided((t.shape[0], per_row), (t.stride(0), 1)).view(as_row_dtype(t.dtype, dtype))
                     for t in layers]
        self.device = layers[0].device

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.stack([r.index_select(0, ids) for r in self.rows], dim=1)

    def scatter(self, ids: torch.Tensor, src: torch.Tensor) -> None:
        for layer, r in enumerate(self.rows):
            r.index_copy_(0, ids, as_engine_dtype(src[:, layer].reshape(len(ids), -1), r.dtype))


class _KVPart:
    """K/V per token through a single-group layout of the group's tensors."""

    def __init__(self, ns: Namespace, group: KVGroup, kv, declared: str | None) -> None:
        sub = Namespace(model_id=ns.model_id, dtype=group.dtype, num_layers=group.num_layers,
                        num_kv_heads=group.shape[1], head_dim=group.shape[2], block_size=ns.block_size)
        self.layout: KVLayout = make_layout(sub, kv, declared)
        self.device = self.layout.device

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        return self.layout.gather(ids)

    def scatter(self, ids: torch.Tensor, src: torch.Tensor) -> None:
        self.layout.scatter(ids, src)


def _part(ns: Namespace, index: int, kv, declared: str | None):
    group = ns.groups[index]
    what = f"KV group {index} ({group.kind})"
    try:
        if group.kind == "mla":
            return _RowsPart(group, _layers(kv, group, what), ns.block_size * group.shape[0], what)
        if group.is_state:
            return _RowsPart(group, _layers(kv, group, what), prod(group.shape), what)
        return _KVPart(ns, group, kv, declared)
    except ConfigError as exc:
        if str(exc).startswith(what):
            raise
        raise ConfigError(f"{what}: {exc}") from None


class GroupLayout:
    """Gather and scatter whole entries (block entries and state entries) of a grouped namespace."""

    name = "groups"

    def __init__(self, ns: Namespace, kv: Sequence, declared: str | None = None) -> None:
        if isinstance(kv, (Mapping, torch.Tensor)) or len(kv) != len(ns.groups):
            raise ConfigError(f"a namespace with {len(ns.groups)} KV groups registers one entry per group, "
                              f"got {type(kv).__name__}")
        self.ns = ns
        self.plan = ns.entry_plan
        self.token = token_groups(ns.groups)
        self.state = state_groups(ns.groups)
        self.parts = [_part(ns, i, group_kv, declared) for i, group_kv in enumerate(kv)]
        devices = {p.device for p in self.parts}
        if len(devices) != 1:
            raise ConfigError(f"KV groups live on several devices: {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.dtype = torch_dtype(ns.dtype)
        self.name = "groups:" + ",".join(getattr(getattr(p, "layout", None), "name", ns.groups[i].kind)
                                         for i, p in enumerate(self.parts))

    def _pack(self, which: list[int], ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[0]
        out = torch.zeros((n, self.plan.entry_nbytes), dtype=torch.uint8, device=self.device)
        for col, gi in enumerate(which):
            off, size = self.plan.offsets[gi], self.plan.sizes[gi]
            part = self.parts[gi].gather(ids[:, col]).contiguous()
            out[:, off : off + size] = part.view(n, -1).view(torch.uint8)
        return out.view(self.dtype)

    def _unpack(self, which: list[int], ids: torch.Tensor, src: torch.Tensor) -> None:
        # Never makes the host wait for the device: ``ids`` live there on CUDA (and this runs in
        # vLLM's get_finished), where ``.any()`` or a boolean mask waited for the whole queued
        # forward. So every row is written, none dropped: a row with no block (-1) in a group is
        # sent to the group's first kept row, with that row's bytes (the same write twice), or,
        # where no row keeps a block of the group, to block 0 with the bytes it holds (read just
        # before, on the same stream).
        n = ids.shape[0]
        if n == 0:
            return
        data = src.reshape(n, -1).view(torch.uint8)
        for col, gi in enumerate(which):
            group, part = self.ns.groups[gi], self.parts[gi]
            off, size = self.plan.offsets[gi], self.plan.sizes[gi]
            col_ids, entries = ids[:, col], data[:, off : off + size]
            keep = col_ids >= 0
            first = keep.to(torch.int32).argmax().view(1)  # the first kept row (0 when none is)
            fill_id = col_ids.index_select(0, first).clamp(min=0)
            held = part.gather(fill_id).contiguous().view(1, -1).view(torch.uint8)
            fill = torch.where(keep.index_select(0, first).view(1, 1), entries.index_select(0, first), held)
            rows = torch.where(keep.view(n, 1), entries, fill)
            part.scatter(torch.where(keep, col_ids, fill_id),
                         rows.view(torch_dtype(group.dtype)).view(n, *group.part_shape(self.ns.block_size)))

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Block entries ``[n, entry]`` of the token-group rows ``[n, token groups]``."""
        return self._pack(self.token, rows.view(rows.shape[0], -1))

    def scatter(self, rows: torch.Tensor, src: torch.Tensor) -> None:
        """Write block entries ``src`` into the rows' blocks (ids of -1 are skipped)."""
        self._unpack(self.token, rows.view(rows.shape[0], -1), src)

    def gather_state(self, ids: torch.Tensor) -> torch.Tensor:
        """State entries ``[n, entry]`` of the state-group slots ``[n, state groups]``."""
        return self._pack(self.state, ids.view(ids.shape[0], -1))

    def scatter_state(self, ids: torch.Tensor, src: torch.Tensor) -> None:
        self._unpack(self.state, ids.view(ids.shape[0], -1), src)
