"""The worker's copies that touch the engine's device blocks off its own path: loaded host slots
scattered into device blocks (on CUDA through the worker's load stream, so the slab upload does
not queue behind the engine's work), and settling the save side stream after a gather failed."""

from __future__ import annotations

import logging

import torch

from tiered_kv.connector.host_spans import scatter_spans
from tiered_kv.connector.layout import KVLayout, device_ids

log = logging.getLogger(__name__)


def scatter(layout, host_slots, load_stream, block_ids: list, slots: list[int], state: bool = False) -> None:
    """Host ``slots`` (of the store's :class:`~tiered_kv.store.host_slots.HostSlots`
    ``host_slots``) into the device blocks ``block_ids`` of ``layout``: on CPU a strided copy
    per run of consecutive slots and blocks; on CUDA slab to device on ``load_stream``, the
    scatter queued on the engine's stream after it; waits for the copies alone (the slots are
    released next)."""
    assert layout is not None, "register_kv_caches was not called"
    device = layout.device
    scatter_ = layout.scatter_state if state else layout.scatter
    if device.type != "cuda":
        if state or not isinstance(layout, KVLayout) or not scatter_spans(layout, host_slots, block_ids, slots):
            scatter_(torch.tensor(block_ids), host_slots.gather(slots))
        return
    current = torch.cuda.current_stream(device)
    with torch.cuda.stream(load_stream):  # not behind the engine's queued work
        src = host_slots.to_device(slots, device)  # allocated on the load stream
        copied = torch.cuda.Event()
        copied.record(load_stream)
    current.wait_event(copied)
    src.record_stream(current)  # the scatter reads it on the engine's stream
    scatter_(device_ids(block_ids, device), src)
    copied.synchronize()


def settle_side_stream(stream) -> None:
    """Wait for what a failed gather queued on the save side ``stream`` (None: none): a copy into
    host slots that are freed, then another block's, would overwrite it (a broken context runs
    nothing more)."""
    try:
        if stream is not None:
            stream.synchronize()
    except Exception:
        log.exception("the save stream could not be synchronized")
