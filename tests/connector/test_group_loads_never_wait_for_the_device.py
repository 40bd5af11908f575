"""A load into a model with KV groups never makes the host wait for the device.

On CUDA the block ids of a load live on the device, and the scatter runs in vLLM's
``get_finished``: a ``.any()`` or a boolean mask over them made the host wait for the whole
queued forward, several times per group, each step that finished an async load. The scatter is
run here on CPU tensors under a dispatch mode that records every op torch is asked for: none may
read a value back to the host or select rows with a boolean mask, and the blocks must end up
exactly as a row-by-row copy of the kept ids would leave them."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tiered_kv.connector.group_layout import GroupLayout
from tiered_kv.keys import Namespace
from tiered_kv.kv_groups import KVGroup

BS, H, D, NB = 4, 2, 8, 12
SLIDING = KVGroup("sliding", 2, (2, H, D), "float32", BS, window=2 * BS)
FULL = KVGroup("full", 2, (2, H, D), "float32", BS)
MLA = KVGroup("mla", 3, (12,), "float32", BS)
STATE = KVGroup("state", 2, (40,), "float32", 64)
HOST_WAITS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "nonzero_static", "masked_select",
              "masked_scatter", "equal"}


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.waits: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        indices = args[1] if name in ("index", "index_put", "index_put_") and len(args) > 1 else ()
        if name in HOST_WAITS or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
            self.waits.append(str(func))
        return func(*args, **(kwargs or {}))


def _tensors(group: KVGroup, seed: int):
    gen = torch.Generator().manual_seed(seed)
    if group.kind == "mla":  # one stacked buffer [L, blocks, bs, D]
        return torch.randn((group.num_layers, NB, BS, group.shape[0]), generator=gen)
    shape = (NB, *group.shape) if group.is_state else (NB, 2, BS, H, D)
    return [torch.randn(shape, generator=gen) for _ in range(group.num_layers)]


def _blocks(layout: GroupLayout, gi: int) -> torch.Tensor:
    """Every block of group ``gi`` as bytes ``[NB, part bytes]``."""
    return layout.parts[gi].gather(torch.arange(NB)).contiguous().view(NB, -1).view(torch.uint8).clone()


@pytest.mark.parametrize("groups, rows", [
    ((SLIDING, FULL), [[-1, 3], [-1, 4], [5, 6], [7, 8]]),   # a window's old blocks, then kept ones
    ((SLIDING, FULL), [[-1, 0], [-1, 2]]),                   # no sliding block at all (block 0 is a target)
    ((FULL, SLIDING), [[9, -1], [1, 5], [2, -1], [0, 6]]),   # no block here and there, block 0 in a row
    ((SLIDING, MLA), [[4, 1], [-1, 2], [6, 3]]),             # a stacked MLA buffer
    ((FULL, MLA), [[11, 10]]),                               # one row, everything kept
])
def test_regression_a_grouped_load_waited_for_the_device_on_every_group(groups, rows):
    ns = Namespace("groups-sync", "float32", sum(g.num_layers for g in groups), H, D, BS, groups=groups)
    layout = GroupLayout(ns, [_tensors(g, i + 1) for i, g in enumerate(groups)])
    before = [_blocks(layout, gi) for gi in range(len(groups))]
    ids = torch.tensor(rows)
    src = torch.randn((len(rows), ns.entry_plan.entry_nbytes // 4), generator=torch.Generator().manual_seed(9))
    with _Ops() as ops:
        layout.scatter(ids, src)
    assert ops.waits == []
    entries = src.view(torch.uint8)
    for gi in range(len(groups)):
        expected = before[gi].clone()
        off, size = ns.entry_plan.offsets[gi], ns.entry_plan.sizes[gi]
        for r, row in enumerate(rows):
            if row[gi] >= 0:
                expected[row[gi]] = entries[r, off : off + size]
        assert torch.equal(_blocks(layout, gi), expected), f"group {gi}"


def test_regression_a_state_load_waited_for_the_device():
    ns = Namespace("groups-sync", "float32", 4, H, D, BS, groups=(FULL, STATE))
    layout = GroupLayout(ns, [_tensors(FULL, 1), _tensors(STATE, 2)])
    before = _blocks(layout, 1)
    src = layout.gather_state(torch.tensor([[3]]))
    with _Ops() as ops:
        layout.scatter_state(torch.tensor([[7]]), src)
    assert ops.waits == []
    before[7] = before[3]
    assert torch.equal(_blocks(layout, 1), before)
