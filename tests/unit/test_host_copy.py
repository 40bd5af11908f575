"""Host copies split over helper threads: every block lands, whatever thread copies it."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tiered_kv.store.host_copy import HostCopier


def blocks(n: int, nbytes: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(n)]


@pytest.mark.parametrize("threads, n, nbytes", [(1, 8, 1 << 20), (2, 1, 8 << 20), (2, 3, 64),
                                                (2, 40, 1 << 20), (4, 17, 512 << 10)])
def test_every_block_is_copied_serially_or_in_parallel(threads, n, nbytes):
    copier = HostCopier(threads, min_bytes=1 << 20)
    src, dst = blocks(n, nbytes, 1), [np.zeros(nbytes, np.uint8) for _ in range(n)]
    try:
        copier.copy(list(zip(dst, src)))
    finally:
        copier.close()
    assert all(np.array_equal(d, s) for d, s in zip(dst, src))


def test_a_helper_that_never_runs_is_not_waited_for():
    copier = HostCopier(2, min_bytes=0)
    gate = threading.Event()
    copier._pool.submit(gate.wait)  # the only helper thread is busy elsewhere
    src, dst = blocks(6, 4096, 2), [np.zeros(4096, np.uint8) for _ in range(6)]
    try:
        copier.copy(list(zip(dst, src)))  # the caller copies everything and cancels the helper job
        assert all(np.array_equal(d, s) for d, s in zip(dst, src))
    finally:
        gate.set()
        copier.close()


def test_a_failed_copy_raises_after_every_helper_stopped():
    copier = HostCopier(2, min_bytes=0)
    src = blocks(8, 4096, 3)
    dst = [np.zeros(4096, np.uint8) for _ in range(7)] + [np.zeros(17, np.uint8)]  # wrong size
    try:
        with pytest.raises(ValueError):
            copier.copy(list(zip(dst, src)))
        # checked before close(): copy() itself waited for the helper
        assert all(np.array_equal(d, s) for d, s in zip(dst[:7], src[:7]))
    finally:
        copier.close()


def test_a_copier_closed_under_a_caller_copies_alone():
    copier = HostCopier(3, min_bytes=0)
    copier._pool.shutdown()  # what a concurrent close() or interpreter exit leaves behind
    src, dst = blocks(5, 4096, 4), [np.zeros(4096, np.uint8) for _ in range(5)]
    copier.copy(list(zip(dst, src)))
    assert all(np.array_equal(d, s) for d, s in zip(dst, src))
    copier.close()
