"""The host tier's slots seen as blocks: each slot as a canonical block tensor, batched copies
between slots and callers' block tensors, and gathers/fills of many slots for the connector's
worker (which never touches the slab itself)."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import torch

from storage_backends.host import HostBackend
from storage_backends.host_slab import no_slab
from tiered_kv.dtypes import torch_dtype
from tiered_kv.errors import BlockMismatch
from tiered_kv.keys import Namespace
from tiered_kv.store.host_copy import HostCopier

SMALL_BLOCK_ITEMS = 32768  # blocks of at most this many elements are copied by torch in batches
# (64 KiB of bf16; torch copies them on the calling thread); larger ones as one memcpy each
# (torch's copy would go to its OpenMP pool: see HostSlots.plain)
VIEW_CHUNK = 256  # slot tensors are made this many at a time, when the first of them is asked for
RUN_PIECE_BLOCKS = 64  # small blocks in consecutive slots are copied this many per torch call
# (one share of a batch for the copier's threads)
_KIND = operator.attrgetter("is_cpu", "dtype", "shape", "layout")  # what a block must match to join a run
_DTYPE = operator.attrgetter("dtype")
_FORM = operator.attrgetter("dtype", "shape", "layout", "is_meta")  # what check asks of a source


def bytes_of(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a flat uint8 array (shares memory)."""
    return t.view(torch.uint8).numpy().reshape(-1)


def bytes_of_each(ts: Sequence[torch.Tensor], accept=None) -> list[np.ndarray] | None:
    """:func:`bytes_of` of each of ``ts`` (contiguous CPU tensors): slices of one array over
    the memory of the first one's storage for those lying in it (the blocks of one pool or
    batch: ~0.35 against 1.7 us a tensor for three torch calls each), :func:`bytes_of` for the
    others. The bytes in that range are the tensor's own whichever storage it belongs to. With
    ``accept``: None unless ``accept(t)`` holds for each of ``ts`` (asked first)."""
    if not ts:
        return []
    if accept is not None and not all(map(accept, ts)):
        return None
    storage = ts[0].untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
    base = storage.data_ptr()
    end = base + len(whole)
    out = []
    for t in ts:
        at, n = t.data_ptr() - base, t.nbytes
        inside = 0 <= at and base + at + n <= end and t.is_contiguous()
        out.append(whole[at : at + n] if inside else bytes_of(t))
    return out


class HostSlots:
    """Blocks of one namespace in the slots of ``host`` (one block per slot)."""

    def __init__(self, host: HostBackend, namespace: Namespace, copier: HostCopier) -> None:
        self.host = host
        self.shape = namespace.block_shape
        self.dtype = torch_dtype(namespace.dtype)
        self.block_nbytes = self.dtype.itemsize * int(np.prod(self.shape))
        self.small = int(np.prod(self.shape)) <= SMALL_BLOCK_ITEMS  # copied by torch in batches
        self.copier = copier  # large batches of memcpys on several threads
        self._views: list[torch.Tensor | None] = [None] * host.num_slots
        self._rows = host.slab.numpy()  # [slot, byte]: host copies without torch ops
        self._blocks = host.slab.view(host.num_slots, host.slot_bytes)[:, : self.block_nbytes]
        # every slot as a canonical block: [slot, *shape] (a strided view when slots are larger)
        self._typed = torch.as_strided(host.slab.view(self.dtype), (host.num_slots, *self.shape),
                                       (host.slot_bytes // self.dtype.itemsize,
                                        *torch.empty(self.shape, device="meta").stride()))

    def close(self) -> None:
        """Drop every view of the slab (before the host tier closes and lets its memory go)."""
        self._views = []
        empty = no_slab(self.host.slot_bytes)
        self._rows, self._blocks, self._typed = empty.numpy(), empty, empty.view(self.dtype)

    def slot_tensor(self, slot: int) -> torch.Tensor:
        """Host slot ``slot`` as a canonical block tensor (shares memory with the slab)."""
        view = self._views[slot]
        if view is None:  # made once per slot, VIEW_CHUNK at a time (an unbind: 0.7 us a view,
            # against 1.6 for one index of the typed slab and ~13 for a view made per copy)
            lo = slot - slot % VIEW_CHUNK
            self._views[lo : lo + VIEW_CHUNK] = self._typed[lo : lo + VIEW_CHUNK].unbind(0)
            view = self._views[slot]
        return view

    def slot_tensors(self, slots: Sequence[int]) -> list[torch.Tensor]:
        """:meth:`slot_tensor` of each of ``slots``."""
        made = self._views
        return [v if (v := made[s]) is not None else self.slot_tensor(s) for s in slots]

    def row(self, slot: int) -> np.ndarray:
        """The block bytes of ``slot`` as a uint8 array (shares memory; for codecs and media)."""
        return self._rows[slot, : self.block_nbytes]

    def plain(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a whole contiguous CPU block of our dtype and shape: copied to and from
        host slots with one memcpy on the calling thread. torch's CPU ``copy_`` splits every block
        over its OpenMP pool, and when another thread holds a core (the transfer pool compressing,
        the engine, a neighbour process) each block waits for a scheduler tick: host copies ran at
        0.2-0.5 GB/s that way against ~6 GB/s for one memcpy (tools/bench_tiers.py, 2 cores)."""
        return (t.is_cpu and t.dtype == self.dtype and t.shape == self.shape
                and t.is_contiguous() and not t.requires_grad)

    def copy_blocks(self, slots: Sequence[int], blocks: Sequence[torch.Tensor], *, into_slots: bool) -> None:
        """Copy canonical block tensors into (or out of) host ``slots``. Small CPU blocks (at
        most SMALL_BLOCK_ITEMS elements): each run of consecutive slots is one ``torch.stack``
        (or ``unbind_copy``) per RUN_PIECE_BLOCKS blocks, whatever lies where in the caller's
        memory (one C++ call and no slot view per block: ~5.3 against ~6.5-8 us a 64 KiB block
        with a ``_foreach_copy_`` over per-slot views, 2 threads), the blocks in no run a
        ``_foreach_copy_`` batch at a time; large plain CPU blocks as one batch of memcpys;
        device blocks (a GPU's) are all queued on their device's current stream (asynchronous
        from and into the pinned slab), then waited for once, so no copy still reads or writes
        a slot when this returns."""
        if len(slots) != len(blocks):  # a run copies blocks[pos:pos + count] into its slots
            raise ValueError(f"{len(blocks)} blocks for {len(slots)} slots")
        if self.small and (into_slots or self.canonical(blocks)):
            pieces, alone = self.slot_pieces(slots)
            if not into_slots:
                try:
                    return self._copy_small(pieces, alone, slots, blocks, into_slots=False)
                except RuntimeError:  # torch refused a destination (one that overlaps itself):
                    for block in blocks:  # the typed refusal when it was that, asked only now
                        self.check(block, dest=True)  # (no per-block work on the normal path)
                    raise
            if self.stackable(blocks, [pos for pos, _, _ in pieces] + alone):
                try:
                    return self._copy_small(pieces, alone, slots, blocks, into_slots=True)
                except RuntimeError:  # a block of another shape or device than its piece's
                    pass  # first, refused before any copy of that piece: the copies below say which
        for block in blocks:  # all before any copy: a refusal leaves every slot and block as it was
            self.check(block, dest=not into_slots)
        plain, devices = [], set()
        # (no autograd: a block that requires grad, or an inference tensor, raised torch's error)
        with torch.inference_mode():
            try:
                self._copy_each(slots, blocks, plain, devices, into_slots)
            finally:  # also when a copy failed: the caller frees these slots next
                for device in devices:
                    torch.cuda.current_stream(device).synchronize()

    def check(self, block: torch.Tensor, *, dest: bool = False) -> None:
        """BlockMismatch unless ``block`` is a dense tensor of our exact shape and dtype holding
        data (and, as a ``dest``ination, no two of its elements at one address): ``copy_`` would
        broadcast one that fits (K into V too) and convert another dtype's values (a block that
        is not the KV the engine computed, a misconfigured namespace hidden), and other shapes,
        tensors and overlapping destinations raised torch's RuntimeError into the engine."""
        if block.shape != self.shape:
            raise BlockMismatch(f"a block of shape {list(block.shape)} for slots of {list(self.shape)}")
        if block.is_meta or block.layout != torch.strided:
            raise BlockMismatch(f"a block on {block.device} ({block.layout}) holds no data to copy")
        if block.dtype != self.dtype:
            raise BlockMismatch(f"a block of {block.dtype} for slots of {self.dtype} (its values would "
                                "be converted: the namespace's dtype is not the engine's?)")
        if dest and not block.is_contiguous() and any(  # torch's sure sign of an overlap: an
                n > 1 and st == 0 for n, st in zip(block.shape, block.stride())):  # expanded dim
            raise BlockMismatch(f"a destination block with strides {block.stride()} writes one "
                                "element to several places")

    def check_all(self, blocks: Sequence[torch.Tensor]) -> None:
        """:meth:`check` of each of ``blocks`` as sources, in one pass over the batch (a block at
        a time only to name the first one refused)."""
        if set(map(_FORM, blocks)) - {(self.dtype, self.shape, torch.strided, False)}:
            for block in blocks:
                self.check(block)

    def _copy_each(self, slots: Sequence[int], blocks: Sequence[torch.Tensor], plain: list, devices: set,
                   into_slots: bool) -> None:
        """:meth:`copy_blocks` a block at a time: plain CPU blocks as one batch of memcpys, the
        others by ``copy_`` (a device's queued on its current stream, added to ``devices``)."""
        for slot, block in zip(slots, blocks):
            if self.plain(block):
                row, mem = self.row(slot), bytes_of(block)
                plain.append((row, mem) if into_slots else (mem, row))
                continue
            queued = block.device.type == "cuda"
            if queued:
                devices.add(block.device)
            if into_slots:
                self.slot_tensor(slot).copy_(block, non_blocking=queued)
            else:
                block.copy_(self.slot_tensor(slot), non_blocking=queued)
        self.copier.copy(plain)

    def _copy_small(self, pieces: list, alone: list[int], slots: Sequence[int], blocks: Sequence[torch.Tensor],
                    *, into_slots: bool) -> None:
        """Small blocks: each piece of a run of slots one ``torch.stack`` / ``unbind_copy``, the
        blocks in no run ``_foreach_copy_`` batches (see :meth:`copy_blocks`)."""
        self.copier.copy_runs([(self._typed[first : first + count], blocks[pos : pos + count])
                               for pos, first, count in pieces], into_slots=into_slots)
        if alone:
            views = self.slot_tensors([slots[i] for i in alone])
            singles = [blocks[i] for i in alone]
            if into_slots:
                self.copier.copy_tensors(views, singles)
            else:
                self.copier.copy_tensors(singles, views)

    def stackable(self, blocks: Sequence[torch.Tensor], leads: Sequence[int]) -> bool:
        """Whether a save may copy ``blocks`` a piece at a time: the blocks ``leads`` (each
        piece's first, and every block in no run, which ``_foreach_copy_`` would broadcast) CPU
        dense tensors of our dtype and exact shape, every block of our dtype. ``stack`` refuses a
        block of another shape or device than its piece's first before it copies any of the
        piece (``out`` is then never resized), so only the dtype, which it would convert, is
        asked of the others: ~60 against 285 ns a block for :meth:`canonical`."""
        kind = (True, self.dtype, self.shape, torch.strided)
        return (len(blocks) > 0 and all(_KIND(blocks[i]) == kind for i in leads)
                and set(map(_DTYPE, blocks)) == {self.dtype})

    def canonical(self, blocks: Sequence[torch.Tensor]) -> bool:
        """Whether every one of ``blocks`` is a dense CPU tensor of our dtype and exact shape (any
        strides): what ``torch.stack`` / ``unbind_copy`` may take with a slab run as ``out``.
        Checked here because both would silently resize ``out`` to another shape, and a
        resized view of the slab reaches into the slots after it."""
        return len(blocks) > 0 and set(map(_KIND, blocks)) == {(True, self.dtype, self.shape, torch.strided)}

    def slot_pieces(self, slots: Sequence[int]) -> tuple[list[tuple[int, int, int]], list[int]]:
        """Runs of at least two consecutive slots, cut into pieces of at most RUN_PIECE_BLOCKS,
        as ``(position in slots, first slot, count)``; and the positions of the slots in no run."""
        pieces: list[tuple[int, int, int]] = []
        alone: list[int] = []
        for pos, count in _consecutive(slots):
            if count == 1:
                alone.append(pos)
                continue
            for lo in range(pos, pos + count, RUN_PIECE_BLOCKS):
                pieces.append((lo, slots[lo], min(RUN_PIECE_BLOCKS, pos + count - lo)))
        return pieces, alone

    def span(self, first: int, count: int, layers: tuple[int, int] | None = None) -> torch.Tensor:
        """Slots ``first .. first + count - 1`` as one ``[count, k, 2, bs, H, D]`` view of the
        slab (layers ``layers[0] .. layers[1] - 1``, or all): no copy, for one strided copy of
        a run of blocks into the engine's."""
        view = self._typed[first : first + count]
        return view if layers is None else view[:, layers[0] : layers[1]]

    def gather(self, slots: Sequence[int]) -> torch.Tensor:
        """The blocks of ``slots`` as one new ``[n, *block shape]`` tensor (one batched copy)."""
        rows = self._blocks.index_select(0, torch.tensor(list(slots), dtype=torch.long))
        return rows.view(self.dtype).view(len(slots), *self.shape)

    def gather_range(self, slots: Sequence[int], start: int, end: int, device: torch.device | None = None) -> torch.Tensor:
        """Bytes ``start:end`` of the blocks of ``slots`` as one new ``[n, end - start]`` uint8
        tensor (a layer group of each block: its leading dimension is the layers). With a
        ``device`` the ranges are copied straight from the (pinned) slab, queued on the current
        CUDA stream: one copy per run of consecutive slots when the range is the whole block,
        else one per slot (a block is ``[layers, ...]``, so a layer group's bytes in consecutive
        slots lie apart, and torch stages a strided host source through pageable memory, on the
        calling thread). The caller waits for that stream before the slots are released."""
        if device is None:
            return self._blocks[:, start:end].index_select(0, torch.tensor(list(slots), dtype=torch.long))
        if start == 0 and end == self.block_nbytes:  # whole blocks: to_device's copy per run of slots
            return self.to_device(slots, device).view(len(slots), -1).view(torch.uint8)
        out = torch.empty((len(slots), end - start), dtype=torch.uint8, device=device)
        for pos, slot in enumerate(slots):  # (each source contiguous: never staged)
            out[pos].copy_(self._blocks[slot, start:end], non_blocking=True)
        return out

    def fill(self, slots: Sequence[int], data: torch.Tensor, *, non_blocking: bool = False) -> None:
        """Write ``data`` (``[n, block bytes]`` uint8, on any device) into ``slots``. With
        ``non_blocking`` the copies (one per run of consecutive slots) are queued on the current
        CUDA stream and the caller waits for its own event before committing the slots.
        BlockMismatch (nothing written) unless ``data`` is a block's bytes for each slot."""
        if data.dtype != torch.uint8 or tuple(data.shape) != (len(slots), self.block_nbytes):
            raise BlockMismatch(f"{tuple(data.shape)} {data.dtype} for {len(slots)} slots of "
                                f"{self.block_nbytes} bytes each (an engine block of another size?)")
        if not non_blocking:
            self._blocks.index_copy_(0, torch.tensor(list(slots), dtype=torch.long), data.to("cpu"))
            return
        for pos, first, count in self.runs(slots):
            self._blocks[first : first + count].copy_(data[pos : pos + count], non_blocking=True)

    def to_device(self, slots: Sequence[int], device: torch.device) -> torch.Tensor:
        """The blocks of ``slots`` as one new ``[n, *block shape]`` tensor on ``device``, copied
        straight from the (pinned) slab, one copy per run of consecutive slots, queued on the
        current stream. The caller waits for that stream before the slots are released."""
        out = torch.empty((len(slots), self.block_nbytes), dtype=torch.uint8, device=device)
        for pos, first, count in self.runs(slots):
            out[pos : pos + count].copy_(self._blocks[first : first + count], non_blocking=True)
        return out.view(self.dtype).view(len(slots), *self.shape)

    def runs(self, slots: Sequence[int]) -> list[tuple[int, int, int]]:
        """``(position in slots, first slot, count)`` for each run of consecutive slots, whose
        blocks lie back to back in the slab (only when a slot holds exactly one block's bytes;
        otherwise every slot is a run of its own)."""
        if self.host.slot_bytes != self.block_nbytes:
            return [(pos, slot, 1) for pos, slot in enumerate(slots)]
        return [(pos, slots[pos], count) for pos, count in _consecutive(slots)]


def _consecutive(slots: Sequence[int]) -> list[tuple[int, int]]:
    """``(position, count)`` of each run of consecutive slot numbers in ``slots``, found with one
    numpy step over the batch (not a Python check per slot)."""
    n = len(slots)
    if n == 0:
        return []
    if slots[-1] - slots[0] == n - 1 and list(slots) == list(range(slots[0], slots[0] + n)):
        return [(0, n)]  # one run (a batch reserved from free slots): a list comparison
    starts = np.concatenate(([0], np.flatnonzero(np.diff(np.asarray(slots, np.int64)) != 1) + 1))
    return list(zip(starts.tolist(), np.diff(starts, append=n).tolist()))
