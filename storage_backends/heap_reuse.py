"""Large allocations kept in the heap rather than mapped afresh for each one.

glibc serves an allocation of at least ``M_MMAP_THRESHOLD`` (128 KiB in a new process) with a
fresh ``mmap`` and unmaps it when it is freed. Each time a mapping is freed it raises the
threshold to that mapping's size (up to 32 MiB on 64-bit) and the heap's trim threshold to twice
that. A Redis reply is a new bytes object the size of the stored block (hiredis and redis-py each
make one per GET). While the threshold is below that size, every reply is a fresh mapping whose
pages fault in as the reply is copied into it, and is then unmapped. First touch runs at a third
to half of a copy's pace here.

A process that once freed a larger buffer already has a raised threshold (an engine that loaded
its weights, say). A fresh one (a tool, a benchmark, a replica that only restores) paid the faults
on every block. On this VM, 512 GETs of 2 MiB blocks ran at 1.1-1.4 GB/s, and at 1.8-2.0 GB/s with
the thresholds raised (the shared harness's script, alternating processes in one hour).

So the Redis tier, once per process, sets the two thresholds to where glibc's own rule puts them
after a 32 MiB free: ``M_MMAP_THRESHOLD`` 32 MiB and ``M_TRIM_THRESHOLD`` 64 MiB. For the whole
process, allocations from 128 KiB to 32 MiB (torch's CPU tensors of that size among them: its
allocator calls ``posix_memalign``) then come from the heaps, and each heap keeps at most 64 MiB
free above its top: a few hundred MiB more resident with many threads (32 threads of 1-3 MiB
buffers: 298 -> 581 MiB, flat after that), as in any process whose glibc raised the thresholds
itself. Larger allocations, pinned and device memory are mapped as before. An operator's
``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or ``glibc.malloc`` tunables win. Without
glibc (musl, macOS) nothing is done."""

from __future__ import annotations

import ctypes
import logging
import os
import threading

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for the threshold it raises (64-bit)
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # as glibc sets it beside a raised mmap threshold
OPERATOR_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

_lock = threading.Lock()
_asked = False


def keep_large_allocations_in_heap() -> bool:
    """Raise glibc's mmap and trim thresholds, once per process (see the module docstring);
    whether this call set them (False: done before, left to the operator, or not glibc)."""
    global _asked
    with _lock:
        if _asked:
            return False
        _asked = True
    if any(os.environ.get(name) for name in OPERATOR_SETTINGS) or "glibc.malloc" in os.environ.get(
            "GLIBC_TUNABLES", ""):
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
        mallopt = ctypes.CDLL(None).mallopt
    except (ValueError, OSError, AttributeError):  # (no confstr name, no libc, no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    log.debug("glibc malloc thresholds %s: mmap %d, trim %d", "set" if done else "refused",
              MMAP_THRESHOLD, TRIM_THRESHOLD)
    return done
