"""Host-to-host block copies spread over helper threads (NumPy releases the GIL while copying).

One memcpy thread moves ~6 GB/s on this class of machine and two move ~12 GB/s, so a batch of
large blocks saved into (or loaded from) host slots is split between the calling thread and
helper threads. All of them take blocks one at a time from one shared index iterator (each
``next`` is atomic): when a helper is not scheduled (its core busy compressing, say) the caller
simply copies everything itself and cancels the helper's job, never waiting for a thread that has
not started. Small batches stay on the
calling thread, where a thread hand-off would cost more than it saves.

Every thread copying for a batch asks for an OpenMP team of one while it copies (its own
setting, put back after the batch; the engine's other threads keep theirs): torch's ``stack``
then copies each small block with its serial memcpy kernel instead of a copy iterator per block
(``openmp_team``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

import numpy as np
import torch

from tiered_kv.store.openmp_team import find_openmp, one_thread_team

PARALLEL_MIN_BYTES = 4 << 20  # below this a batch is copied on the calling thread (a helper's
# wake-up costs about what it saves on a 2 MiB batch of 64 KiB blocks)
TENSORS_PER_CALL = 64  # small blocks per torch._foreach_copy_ call (one share of a batch)


class HostCopier:
    """Copies ``(destination, source)`` array pairs, in parallel when the batch is large."""

    def __init__(self, threads: int, min_bytes: int = PARALLEL_MIN_BYTES) -> None:
        self.helpers = max(0, int(threads) - 1)
        self.min_bytes = min_bytes
        find_openmp()  # now, not in the first batch's copy (a look at every loaded library)
        self._pool = (ThreadPoolExecutor(self.helpers, thread_name_prefix="tiered-kv-copy")
                      if self.helpers else None)
        for _ in range(self.helpers):  # started now: the first batches must not wait for a thread
            self._pool.submit(int)  # type: ignore[union-attr]  # (an executor starts one per submit)

    def copy(self, pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        """``np.copyto(dst, src)`` for every pair (large blocks: one memcpy each)."""
        def run(i: int) -> None:
            np.copyto(*pairs[i])

        self._spread(len(pairs), sum(dst.nbytes for dst, _ in pairs), run, torch_kernels=False)

    def copy_tensors(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        """``dst.copy_(src)`` for every pair of CPU tensors, ``TENSORS_PER_CALL`` pairs per
        ``torch._foreach_copy_`` (small blocks: the per-block Python work of a copy costs more
        than the copy itself). No autograd: these are copies of data, never of a graph."""
        shares = range(0, len(dsts), TENSORS_PER_CALL)

        def run(i: int) -> None:
            lo = shares[i]
            # torch's modes are per thread: on a helper the caller's inference mode is not on,
            # and an in-place copy into (or from) inference tensors would be refused
            with torch.inference_mode():
                torch._foreach_copy_(list(dsts[lo : lo + TENSORS_PER_CALL]),
                                     list(srcs[lo : lo + TENSORS_PER_CALL]))

        self._spread(len(shares), sum(d.nbytes for d in dsts), run)

    def copy_runs(self, runs: Sequence[tuple[torch.Tensor, Sequence[torch.Tensor]]], *, into_slots: bool) -> None:
        """For each ``(rows, blocks)``: ``torch.stack(blocks, out=rows)`` (into the slab's run
        of slots ``rows``), or with ``into_slots`` false ``torch.unbind_copy(rows, out=blocks)``.
        One C++ call per run, with the GIL released: no per-block Python work and no view of
        each slot. The caller has checked that every block has the slab's dtype and shape (both
        calls would resize ``rows`` or a block to fit, not refuse)."""
        def run(i: int) -> None:
            rows, blocks = runs[i]
            with torch.inference_mode():  # as in copy_tensors: a helper's mode is its own
                if into_slots:
                    torch.stack(list(blocks), out=rows)
                else:
                    torch.unbind_copy(rows, 0, out=list(blocks))

        self._spread(len(runs), sum(rows.nbytes for rows, _ in runs), run)

    def _spread(self, count: int, nbytes: int, run: Callable[[int], None], torch_kernels: bool = True) -> None:
        """``run(i)`` for i in range(count), on this thread and the helpers when it is worth it;
        with ``torch_kernels`` each copying thread has an OpenMP team of one meanwhile."""
        if count == 0:
            return
        pool = self._pool  # read once: close() may run concurrently
        indices = iter(range(count))

        def drain() -> None:
            with one_thread_team() if torch_kernels else nullcontext():
                for i in indices:
                    run(i)

        if pool is None or count < 2 or nbytes < self.min_bytes:
            drain()
            return

        futures = []
        try:
            for _ in range(min(self.helpers, count - 1)):
                try:
                    futures.append(pool.submit(drain))
                except RuntimeError:  # pool shut down (close(), interpreter exit): copy alone
                    break
            drain()
        finally:  # never return (or raise) while a helper may still write into a destination
            errors = [f.exception() for f in futures if not f.cancel()]
        for exc in errors:
            if exc is not None:
                raise exc

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

