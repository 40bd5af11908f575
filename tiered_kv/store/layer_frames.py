"""How a stored block is framed in layer groups (no torch here: the scheduler's restore policy
asks how many frames a block streams in). A block's leading dimension is its layers; up to
``layer_groups`` frames, as even as the layers allow, none smaller than ``MIN_FRAME_BYTES``
(a frame is compressed, checked and, with encryption, sealed on its own: smaller ones cost more
per byte than they gain in pipelining)."""

from __future__ import annotations

from tiered_kv.keys import Namespace

# a frame costs a fixed few microseconds to open, hash and decode on its own: frames below this
# would make layer-wise loads slower than whole ones (a 2 MiB Llama-8B block still gets 8 groups)
MIN_FRAME_BYTES = 64 << 10


def layer_segments(namespace: Namespace, raw_len: int, groups: int) -> list[int] | None:
    """Raw byte length of each of up to ``groups`` layer groups of a block (its leading dimension
    is the layers: ``[layers, 2, block_size, heads, dim]``), as even as layers allow, none smaller
    than MIN_FRAME_BYTES; None for one frame (a single group or layer, a small block, or a
    namespace with KV groups, whose entry is each group's part one after another)."""
    layers = namespace.num_layers
    groups = min(groups, layers, raw_len // MIN_FRAME_BYTES)
    if groups <= 1 or namespace.groups or raw_len % layers:
        return None
    per_layer = raw_len // layers
    return [per_layer * (layers * (g + 1) // groups - layers * g // groups) for g in range(groups)]


def smallest_frame(namespace: Namespace, raw_len: int, groups: int) -> int:
    """Payload bytes of the smallest frame a block of ``raw_len`` bytes is stored in."""
    return min(layer_segments(namespace, raw_len, groups) or (raw_len,))


def frame_count(namespace: Namespace, raw_len: int, groups: int) -> int:
    """Frames a block of ``raw_len`` payload bytes is stored in (1: it arrives whole)."""
    return len(layer_segments(namespace, raw_len, groups) or (0,))
