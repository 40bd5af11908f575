"""Layer-wise sync loads: the blocks a step loads arrive layer group by layer group, and the
engine's ``wait_for_layer_load(layer)`` waits only for that layer's part of them, so layer ``l``
is computed while the layers after it are still being read and decoded.

The store's load jobs decode every block's first frame, then every block's second, ... (each
frame checked before a byte of it is used; :class:`~tiered_kv.store.load_progress.LoadProgress`
says how far each block got). Before layer ``l`` this copies into the engine's blocks the layers
``done .. upto - 1`` of every block still good, where ``upto`` > ``l`` is as far as all of them
have arrived (a frame of several layers is copied at once). A block whose frame fails is left
out of later copies and reported as a load error when the step ends, exactly as a whole-block
load: the engine recomputes it, and nothing unchecked ever reached the model. An engine that
ends the forward without waiting for every layer gets every block of these loads reported as
failed (its layers were read before they arrived), never silently wrong KV.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from tiered_kv.connector.host_spans import scatter_spans
from tiered_kv.connector.layout import KVLayout, device_ids

log = logging.getLogger(__name__)


class LayerLoads:
    """The sync loads of one step. ``pendings``: the worker's loads (each a ``spec`` naming the
    device ``block_ids`` and the store's ``plan``, started layered); ``slots``: the store's
    :class:`~tiered_kv.store.host_slots.HostSlots`; ``load_stream``: the CUDA stream host copies
    run on (None on CPU)."""

    def __init__(self, pendings: Sequence, layout: KVLayout, slots, num_layers: int, load_stream=None) -> None:
        self.pendings = list(pendings)
        self.loads = [(p.spec.block_ids, p.plan) for p in self.pendings]
        self.layout = layout
        self.slots = slots
        self.num_layers = num_layers
        self.layer_bytes = slots.block_nbytes // num_layers
        self.load_stream = load_stream
        self.done = 0  # layers copied into the engine's blocks so far
        self.copy_seconds = 0.0  # time spent copying into the engine's blocks
        self._events: list = []  # CUDA copies still reading host slots
        self.broken = False  # a copy into the engine failed: every block of these loads fails

    @property
    def complete(self) -> bool:
        """Every layer of every good block reached the engine before it was read."""
        return self.done >= self.num_layers and not self.broken

    @property
    def seconds(self) -> float:
        """The restore's time: the longest read of its plans, and the copies into the engine."""
        return max((plan.read_seconds for _, plan in self.loads), default=0.0) + self.copy_seconds

    def wait(self, layer: int) -> None:
        """Every good block's layers up to ``layer`` are in the engine's blocks (or queued before
        the engine's next work on CUDA)."""
        if layer < self.done or self.done >= self.num_layers or self.broken:
            return
        try:
            self._wait(layer)
        except Exception:  # the blocks are reported failed when the step ends
            log.exception("layer-wise load of layer %d failed", layer)
            self.broken = True

    def _wait(self, layer: int) -> None:
        need = (layer + 1) * self.layer_bytes
        for _, plan in self.loads:
            plan.progress.wait(need)
        live = [(ids, plan, self._live(plan)) for ids, plan in self.loads]
        ready = [plan.progress.ready[i] for _, plan, good in live for i in good]
        upto = min([r // self.layer_bytes for r in ready] + [self.num_layers]) if ready else self.num_layers
        # (a layer past the namespace's, as an adapter counting from 1 asks last: every layer;
        # copied as such it was a copy past the blocks' end that failed every block, every step)
        upto = min(max(upto, layer + 1), self.num_layers)
        block_ids = [ids[i] for ids, _, good in live for i in good]
        slots = [plan.progress.slot[i] for _, plan, good in live for i in good]
        if block_ids:
            self._copy(block_ids, slots, self.done, upto)
        self.done = upto

    @staticmethod
    def _live(plan) -> list[int]:
        """Blocks of ``plan`` still good: held in a slot and not ended without being loaded."""
        progress = plan.progress
        return [i for i in range(len(plan.keys))
                if progress.slot[i] is not None and not (progress.over[i] and plan.slots[i] is None)]

    def _copy(self, block_ids: list[int], slots: list[int], first: int, end: int) -> None:
        start = time.perf_counter()
        layout = self.layout
        a, b = first * self.layer_bytes, end * self.layer_bytes
        shape = (len(block_ids), end - first, *layout.block[1:])
        device = layout.device
        if device.type != "cuda":
            if not scatter_spans(layout, self.slots, block_ids, slots, (first, end)):
                src = self.slots.gather_range(slots, a, b).view(self.slots.dtype).view(shape)
                layout.scatter_layers(torch.tensor(block_ids), src, first)
        else:
            current = torch.cuda.current_stream(device)
            with torch.cuda.stream(self.load_stream):
                src = self.slots.gather_range(slots, a, b, device)
                copied = torch.cuda.Event()
                copied.record(self.load_stream)
            current.wait_event(copied)
            src.record_stream(current)
            layout.scatter_layers(device_ids(block_ids, device), src.view(self.slots.dtype).view(shape), first)
            self._events.append(copied)
        self.copy_seconds += time.perf_counter() - start

    def finish(self) -> bool:
        """Wait for every load to end and every copy out of host slots to complete (the slots
        are released next). False when the engine ended its forward without waiting for every
        layer (it cannot use layer-wise loads)."""
        for _, plan in self.loads:
            plan.progress.wait_all()
            try:
                plan.wait()
            except Exception:  # a job that failed as a whole: its blocks are errors
                log.exception("a layer-wise load job failed")
        for event in self._events:
            event.synchronize()
        self._events = []
        if self.done < self.num_layers and not self.broken:
            log.warning("the engine ended a forward without waiting for layers %d..%d of its "
                        "layer-wise loads: those blocks are recomputed, and loads are whole from "
                        "now on", self.done, self.num_layers - 1)
            return False
        return True
