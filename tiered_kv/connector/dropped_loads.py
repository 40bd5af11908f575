"""Async loads the worker dropped before reporting them, released once their reads ended.

Releasing a plan waits for its reads to leave the host slots (a job may still write into them),
and a read from a slow or hung lower tier takes up to that tier's timeout times its tries: done
on the engine's thread (``start_load_kv``, which drops the first of two async loads under one
request id) that would stall the forward pass. So a dropped plan is kept here and released by
:meth:`DroppedLoads.sweep` (each ``get_finished``) once every read of it ended: no wait, and no
lease leaked (the list holds only plans whose reads are still running). A dropped plan is never
scattered: its blocks belong to the load that replaced it, or to no one.
"""

from __future__ import annotations

from tiered_kv.store import LoadPlan, TieredStore


class DroppedLoads:
    """Plans of dropped async loads whose reads may still be running."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self._plans: list[LoadPlan] = []

    def __len__(self) -> int:
        return len(self._plans)

    def add(self, plan: LoadPlan) -> None:
        """Release ``plan`` now when its reads ended, else at a later :meth:`sweep`."""
        self._plans.append(plan)
        self.sweep()

    def sweep(self) -> None:
        """Release every kept plan whose reads all ended (never waits)."""
        if not self._plans:
            return
        done, running = [], []
        for plan in self._plans:  # (one look at each: a plan done meanwhile waits for the next sweep)
            (done if plan.done() else running).append(plan)
        self._plans = running
        for plan in done:
            self.store.release(plan)

    def release_all(self) -> None:
        """Release every kept plan, waiting for its reads (closing: as the worker's loads in flight)."""
        plans, self._plans = self._plans, []
        for plan in plans:
            self.store.release(plan)
