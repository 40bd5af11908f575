"""What :meth:`TieredStore.flush` waits for and does: every write queued (the pool's
write-behind, and copies up past the write-behind budget, which run on threads of their own),
then each lower tier made durable."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from tiered_kv.store.copies_up import CopiesUp
from tiered_kv.store.encoded_tier import EncodedTier
from tiered_kv.store.transfer import TransferPool

log = logging.getLogger(__name__)


def drain_writes(pool: TransferPool, copies: CopiesUp, timeout: float | None) -> bool:
    """Wait until the pool is idle and no copy up past the budget is being written, at most
    ``timeout`` seconds in all; False when something is still running then. (A copy past the
    budget outlived the pool's drain: a flush said every write was done, and a close after it
    closed the tier under that copy, lost without a word.)"""
    end = None if timeout is None else time.monotonic() + timeout
    done = pool.drain(timeout)
    return copies.drain(None if end is None else max(0.0, end - time.monotonic())) and done


def flush_tiers(tiers: Sequence[EncodedTier], entering: Callable[[EncodedTier], bool] | None = None) -> None:
    """Make every lower tier durable; the first tier's failure is raised once every tier
    flushed (it stopped at the first: the tiers after it were never made durable).
    ``entering(tier)``: asked before each tier; False stops there (a close gave up waiting)."""
    failed: Exception | None = None
    for tier in tiers:
        if entering is not None and not entering(tier):
            break
        try:
            tier.backend.flush()
        except Exception as exc:
            if failed is not None:
                log.warning("%s tier: flush failed: %s", tier.name, exc)
            failed = failed or exc
    if failed is not None:
        raise failed
