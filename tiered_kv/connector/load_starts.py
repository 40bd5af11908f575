"""How the worker starts one request's load: the lease taken, the reads queued in the store's pool.

A load planned after the store was closed (an engine stepping on while it shuts down, or a step
racing the close) is no error for the engine and never a stalled forward: every block of it
fails, reported as load errors exactly as a load job that failed as a whole (the engine
recomputes them), counted as ``store_closed`` misses and logged once per store.
"""

from __future__ import annotations

import logging

from tiered_kv.connector.meta import LoadSpec
from tiered_kv.errors import StoreClosed
from tiered_kv.store import LoadPlan, TieredStore
from tiered_kv.store.loading import CLOSED  # (the miss reason of blocks a closed store did not read)

log = logging.getLogger(__name__)


def start_load(store: TieredStore, spec: LoadSpec, layered: bool) -> LoadPlan:
    """``spec``'s plan with its reads started (``layered``: layer group by layer group); once
    the store is closed, a plan released already whose every block failed."""
    keys = list(spec.keys) + ([spec.state_key] if spec.state_key else [])
    plan = None
    try:
        plan = store.take_lease(spec.request_id, keys, spec.tenant)
        return store.loader.load(plan, layered=layered)
    except StoreClosed:
        if plan is not None:
            store.release(plan)  # (no job of it was queued, Loader.load raises only then: no wait)
    n = len(keys)
    if not store.metrics.misses(CLOSED):
        log.warning("request %s: a load after the store was closed; its %d blocks (and those of "
                    "later loads, counted as %s misses) are recomputed", spec.request_id, n, CLOSED)
    store.metrics.miss("host", CLOSED, n)
    return failed_plan(keys)


def failed_plan(keys: list[bytes]) -> LoadPlan:
    """A released plan of ``keys`` whose every block failed (``store_closed``)."""
    n = len(keys)
    return LoadPlan(keys, [None] * n, slots=[None] * n, reasons=[CLOSED] * n, served=[None] * n,
                    released=True)
