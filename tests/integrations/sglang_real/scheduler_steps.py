"""What SGLang's scheduler loop does around a ``UnifiedRadixCache`` between batches, for the role
processes: poll HiCache events (``check_hicache_events``: write acks, storage queues) and, at
admission, ask whether a request's storage prefetch may stop (``check_prefetch_progress``, which
applies the prefetch stop policy). Every wait here is a poll of SGLang's own state with a hang
guard, so a broken thread fails the scenario instead of hanging it; nothing is timed.
"""

from __future__ import annotations

import time
from array import array

HANG_GUARD_S = 120.0
POLL_S = 0.01


def _pump_until(cache, done, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        cache.check_hicache_events()
        if done():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"hang guard: {what} did not happen")
        time.sleep(POLL_S)


def settle_writes(cache) -> None:
    """Run scheduler steps until every host backup the tree started is acknowledged and every
    L3 write it led to is done."""
    _pump_until(cache, lambda: not cache.ongoing_write_through and not cache.ongoing_backup,
                "the host backups and their L3 writes")
    cache.drain_storage_control_queues()


def _kv_landed(cache, handle) -> bool:
    """The prefetch read every page its hit query found into the host pool (SGLang's own test of
    "KV landed" in its timeout policy), or it is no longer pending."""
    ongoing = cache.ongoing_prefetch.get(handle)
    if ongoing is None:
        return True
    op = ongoing.operation
    return (op.host_indices is not None and op.hash_value is not None
            and op.completed_tokens >= len(op.hash_value) * cache.page_size)


def prefetch(cache, tokens: list[int], handle, *, admit: str) -> None:
    """Start a storage prefetch of ``tokens`` from the root, as the scheduler does for a new
    request, then admit the request. ``admit="at_once"``: the admission poll comes on the first
    scheduler step (under ``best_effort`` that stops the prefetch wherever it is; the other
    policies keep it going until they let it stop). ``admit="after_landing"``: the request waits
    in the queue until the prefetch read all it found, then is admitted."""
    cache.prefetch_from_storage(handle, cache.root_node_handle(), array("q", tokens), None, None)
    if admit == "after_landing":
        _pump_until(cache, lambda: _kv_landed(cache, handle), "the prefetch's reads")
    elif admit != "at_once":
        raise ValueError(f"admit must be 'at_once' or 'after_landing', got {admit!r}")
    _pump_until(cache, lambda: cache.check_prefetch_progress(handle), "the prefetch's end")
