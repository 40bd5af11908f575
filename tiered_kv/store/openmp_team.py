"""The calling thread's OpenMP team, one thread for a while.

torch's CPU ``cat`` (under ``torch.stack``) copies a contiguous result of more than 32,768
elements with its serial kernel, one memcpy per input, only when the calling thread's team is
one (``at::get_num_threads() == 1``, and for float, double and bfloat16); otherwise each input
goes through a copy iterator of its own. A 64 KiB bf16 block is exactly 32,768 elements, so no
parallel region is opened either way: the team size only picks the kernel. The host copier
splits a batch over its own threads already, so each of them asks for a team of one while it
copies: 2-thread stacks of 1,024 × 64 KiB blocks ran at 14.9 GB/s with the engine's team of two
against 16.5 with a team of one (alternating rounds in one process). The team size is per thread
(OpenMP's ``nthreads-var``), so the engine's own threads, and this one after the ``with``, keep
theirs. threadpoolctl finds the OpenMP runtime torch loaded and sets it; where it finds none,
nothing is limited.
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
    """A context in which the calling thread's team (what torch's CPU kernels ask of
    ``at::get_num_threads``) is one. The limit is set when this is called: call it in the
    ``with``."""
    controller = find_openmp()
    if controller is None:
        return nullcontext()
    # torch sets a thread's team size at its first parallel call (from its own global setting):
    # have that happen now, or it would undo the limit inside the ``with``
    torch.get_num_threads()
    return _TeamOfOne(controller.lib_controllers)


class _TeamOfOne(AbstractContextManager):
    """Each runtime's team of the calling thread set to one, and put back on leaving. Asked of
    the runtimes' own controllers: threadpoolctl's ``limit`` first lists every library's whole
    state (~4 % of a host load of 64 KiB blocks, which sets this once per copying thread)."""

    def __init__(self, runtimes) -> None:
        self.before = [(lib, lib.get_num_threads()) for lib in runtimes]
        for lib, _ in self.before:
            lib.set_num_threads(1)

    def __exit__(self, *exc) -> None:
        for lib, n in self.before:
            if n is not None:
                lib.set_num_threads(n)
