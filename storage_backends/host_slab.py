"""The host tier's memory: one slab of fixed-size slots, page-locked when CUDA is present,
every page touched when it is made (not in the hot path) and handed back when the tier closes.
Before it is made, its size is measured against what this process can still get
(:mod:`storage_backends.host_memory`): Linux overcommits, so a slab larger than the machine or the
cgroup is mapped fine and the OOM killer ends the engine while it is touched.

A page-locked slab is mapped here and registered with CUDA (``cudaHostRegister``), not taken from
torch's pinned allocator (``pin_memory=True``): that allocator rounds every request up to a power
of two (a 64 GiB slab less one 5 MiB slot locked 128 GiB) and keeps a freed block cached until the
process ends. The registration is undone when the last view of the memory is gone (a closed tier,
or one the collector took), before the memory is unmapped.
"""

from __future__ import annotations

import logging
import mmap
import os
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from storage_backends.host_memory import check_fits
from tiered_kv.errors import ConfigError
from tiered_kv.units import as_bool, format_size

log = logging.getLogger(__name__)


def want_pinned(pinned: str | bool) -> bool:
    """Page-locked memory: "auto" (when CUDA is there) or a bool setting (only with CUDA)."""
    if isinstance(pinned, str) and pinned.strip().lower() == "auto":
        return torch.cuda.is_available()
    return as_bool(pinned, "host pinned (auto, or true / false)") and torch.cuda.is_available()


TOUCH_THREADS = 8  # at most this many threads write the slab's pages when it is made
TOUCH_PIECE_BYTES = 64 << 20  # the slab is touched in pieces of about this size


def new_slab(num_slots: int, slot_bytes: int, pinned: bool) -> torch.Tensor:
    """``[num_slots, slot_bytes]`` uint8, every page touched now; ConfigError when this machine
    will not give that much (it was a raw allocator RuntimeError out of the store's start)."""
    def refused(why: str) -> ConfigError:
        hint = '; or host.pinned = "no": page-locked memory is often capped lower' if pinned else ""
        return ConfigError(f"host.capacity: cannot allocate {format_size(num_slots * slot_bytes)} of "
                           f"{'page-locked ' if pinned else ''}host memory ({why.splitlines()[0][:160]}){hint}")
    if num_slots < 1:  # (a tier that takes every block and keeps none)
        raise ConfigError(f"host.capacity: holds no slot of {format_size(slot_bytes)}")
    check_fits(num_slots * slot_bytes, pinned)  # (before any mapping: no page is touched when refused)
    try:
        if not pinned:
            slab = torch.empty((num_slots, slot_bytes), dtype=torch.uint8)
        else:  # (mapped: page-aligned, and unmapped when its last view is gone)
            private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # (mmap's default is shared: shmem pages)
            mapped = mmap.mmap(-1, max(1, num_slots * slot_bytes), flags=private)
            if hasattr(mmap, "MADV_DONTFORK"):  # a fork copies pinned private pages at once (64 GiB
                mapped.madvise(mmap.MADV_DONTFORK)  # for a 64 GiB slab): children never get it
            flat = np.frombuffer(mapped, dtype=np.uint8)
            slab = torch.from_numpy(flat[: num_slots * slot_bytes]).view(num_slots, slot_bytes)
    except (RuntimeError, OSError) as exc:
        raise refused(str(exc)) from None
    touch(slab.numpy().reshape(-1))
    if pinned and slab.numel():
        runtime = torch.cuda.cudart()
        ptr = slab.data_ptr()
        error = runtime.cudaHostRegister(ptr, slab.numel(), 1)  # (cudaHostRegisterPortable: every device)
        if int(error) != 0:
            raise refused(f"cudaHostRegister: {runtime.cudaGetErrorString(error)}")
        # (runs before the mapping goes; not at the interpreter's exit, when CUDA may be gone)
        weakref.finalize(flat, _unregister, runtime, ptr, os.getpid()).atexit = False
    return slab


def _unregister(runtime, ptr: int, pid: int) -> None:
    if os.getpid() != pid:  # (a forked child holds no registration, nor the memory)
        return
    error = runtime.cudaHostUnregister(ptr)
    if int(error) != 0:
        log.warning("host tier: cudaHostUnregister of its slab failed: %s", runtime.cudaGetErrorString(error))


def settle_copies(pinned: bool) -> None:
    """Before a page-locked slab's views are dropped: the copies queued from or into it on the current
    device are done (the registration goes with the last view, and a copy may still read it)."""
    if pinned and torch.cuda.is_initialized():  # (the engine's device: every other device was
        torch.cuda.synchronize()  # given a context, and its memory, by a synchronize of its own)


def touch(flat: np.ndarray) -> None:
    """Zero ``flat`` on short-lived threads of our own (NumPy releases the GIL while filling).
    Not with torch's ``zero_()``: that runs on torch's OpenMP pool, whose threads then spin,
    waiting for more work, for some milliseconds, on the cores the store's first copies
    need. On 2 vCPUs a 2-thread copy of 1,024 blocks of 64 KiB right after opening ran at
    9.3-10 GB/s into a slab zeroed by torch, against 12.4-12.6 into one zeroed here."""
    count = max(1, -(-flat.nbytes // TOUCH_PIECE_BYTES))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = min(TOUCH_THREADS, count, cores)
    pieces = np.array_split(flat, count)
    if threads == 1:
        for piece in pieces:
            piece.fill(0)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="tiered-kv-touch") as pool:
        list(pool.map(lambda piece: piece.fill(0), pieces))


def no_slab(slot_bytes: int) -> torch.Tensor:
    """What a closed tier holds instead of its slab: no slots, and no view of the old memory
    (a view would keep all of it)."""
    return torch.empty((0, slot_bytes), dtype=torch.uint8)
