"""Loaded blocks from host slots into a CPU engine's blocks without a gather: where both the
slots and the engine's block ids run consecutively (a fresh prompt's blocks, loaded in order),
each run is one strided copy from a view of the slab (``KVLayout.scatter_span``) instead of an
``index_select`` into a new tensor and an ``index_copy_`` out of it (two passes over the bytes,
the second with the engine's transposed strides: ~1.5 GB/s against ~10 here). Blocks scattered
over many short runs take the batched path. CUDA copies go through :mod:`block_copy`."""

from __future__ import annotations

from collections.abc import Sequence

MIN_AVERAGE_RUN = 8  # fewer blocks per run than this: one batched gather and scatter is cheaper


def spans(block_ids: Sequence[int], slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(first block id, first slot, count)`` of each run in which the block ids and the slots
    both go up by one."""
    runs: list[list[int]] = []
    for block, slot in zip(block_ids, slots):
        if runs and runs[-1][0] + runs[-1][2] == block and runs[-1][1] + runs[-1][2] == slot:
            runs[-1][2] += 1
        else:
            runs.append([block, slot, 1])
    return [(b, s, n) for b, s, n in runs]


def scatter_spans(layout, host_slots, block_ids: Sequence[int], slots: Sequence[int],
                  layers: tuple[int, int] | None = None) -> bool:
    """Write the blocks of ``slots`` (layers ``layers[0] .. layers[1] - 1``, or all) into the
    engine blocks ``block_ids``, one strided copy per run; False (nothing written) when they are
    several runs too short to gain over the batched path."""
    runs = spans(block_ids, slots)
    if not runs or (len(runs) > 1 and len(runs) * MIN_AVERAGE_RUN > len(block_ids)):
        return False
    first = 0 if layers is None else layers[0]
    for block, slot, count in runs:
        layout.scatter_span(block, host_slots.span(slot, count, layers), first)
    return True
