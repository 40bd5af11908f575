"""A layer-wise load copies a layer group of each block out of the host slots. On a device the
copies are queued straight from the pinned slab: every block's range was a copy of its own (blocks
x layer groups small copies a step). A range that is the whole block is now one copy per run of
consecutive slots; a smaller one stays a copy per slot, since a block is ``[layers, ...]`` and a
strided host source is staged by torch through pageable memory. Checked on CPU, where the same
copies run (synchronously), against the batched gather: same bytes, each source contiguous."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.store.helpers import NS, make_store, payloads


class _Copies(TorchDispatchMode):
    """(rows copied, whether the source is contiguous) of each copy_ torch is asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "copy_":
            src = args[1]
            self.seen.append((src.shape[0] if src.dim() == 2 else 1, src.is_contiguous()))
        return func(*args, **(kwargs or {}))


def test_regression_a_whole_block_range_was_copied_a_slot_at_a_time(tmp_path):
    with make_store(tmp_path, disk=None) as store:
        slots = store.slots
        assert store.host.slot_bytes == slots.block_nbytes
        order = [7, 8, 9, 10, 2, 3, 20]
        slots.fill(order, torch.stack(payloads(store, len(order), seed=4)).view(len(order), -1).view(torch.uint8))
        layer = slots.block_nbytes // NS.num_layers
        for start, end, runs in [(0, slots.block_nbytes, [4, 2, 1]),  # every layer: a run at a time
                                 (0, layer, [1] * 7), (layer, 3 * layer, [1] * 7)]:  # a layer group
            with _Copies() as copies:
                got = slots.gather_range(order, start, end, torch.device("cpu"))
            assert torch.equal(got, slots.gather_range(order, start, end)), (start, end)
            assert copies.seen == [(n, True) for n in runs], (start, end)


def test_slots_larger_than_a_block_copy_each_whole_block_on_its_own(tmp_path):
    with make_store(tmp_path, disk=None) as store:
        slots = store.slots
        order = [4, 5, 6]
        slots.fill(order, torch.stack(payloads(store, 3, seed=5)).view(3, -1).view(torch.uint8))
        expected = slots.gather_range(order, 0, slots.block_nbytes)
        store.host.slot_bytes += 1  # what a slab of larger slots would look like to runs()
        try:
            with _Copies() as copies:
                got = slots.gather_range(order, 0, slots.block_nbytes, torch.device("cpu"))
        finally:
            store.host.slot_bytes -= 1
        assert torch.equal(got, expected)
        assert copies.seen == [(1, True)] * 3
