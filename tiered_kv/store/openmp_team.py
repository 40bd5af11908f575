"""The calling thread's OpenMP team, one thread for a while.

torch runs a CPU copy of more than 32,768 elements (a 64 KiB bf16 block) over its OpenMP team:
two threads on this project's 2-vCPU VM. The host copier already splits a batch between its own
threads, one block list each, so every block copy of each of them forked a team of two, and the
four threads met at a barrier per block on two cores: 2-thread copies of 1,024 × 64 KiB blocks
ran at 14.9 GB/s against 16.5 with a team of one per copying thread (alternating rounds in one
process). The team size is per thread (OpenMP's ``nthreads-var``), so the engine's own threads,
and this one after the ``with``, keep theirs. threadpoolctl finds the OpenMP runtime torch
loaded and sets it; where it finds none, nothing is limited.
"""

from __future__ import annotations

import functools
import logging
from contextlib import AbstractContextManager, nullcontext

import torch

log = logging.getLogger(__name__)


@functools.cache
def find_openmp():
    """threadpoolctl's controller of the OpenMP runtimes loaded now (torch's among them); None
    when there is none or threadpoolctl cannot look."""
    try:
        from threadpoolctl import ThreadpoolController
        controller = ThreadpoolController().select(user_api="openmp")
    except Exception as exc:  # noqa: BLE001  # a missing or failing inspection costs speed only
        log.debug("OpenMP runtimes not inspected: %s", exc)
        return None
    return controller if controller.lib_controllers else None


def one_thread_team() -> AbstractContextManager:
    """A context in which the calling thread's OpenMP parallel regions (torch's CPU kernels) run
    on this thread alone. The limit is set when this is called: call it in the ``with``."""
    controller = find_openmp()
    if controller is None:
        return nullcontext()
    # torch sets a thread's team size at its first parallel call (from its own global setting):
    # have that happen now, or it would undo the limit inside the ``with``
    torch.get_num_threads()
    return controller.limit(limits=1)
