"""What the worker half teaches the store's cost estimates (``TieredStore.costs``, used by the
scheduler half's restore policy): how long restores took, per serving tier and bytes, and how
long the engine's forward took for steps that loaded nothing (their new tokens and attention
work, as the scheduler put them in the step's metadata). A store without estimates is left alone.
"""

from __future__ import annotations

import time
from collections.abc import Sequence


class CostObserver:
    """Handed the store whose ``costs`` (if any) it feeds."""

    def __init__(self, store) -> None:
        self.store = store
        self._step_start: float | None = None  # a step without loads: when its forward began

    @property
    def costs(self):
        return getattr(self.store, "costs", None)

    def restored(self, plans: Sequence, seconds: float) -> None:
        """One step's sync loads took ``seconds`` until their blocks were in the engine's memory;
        observed when every block came from one tier (the host counts as one)."""
        costs = self.costs
        tiers = {t for plan in plans for t in plan.served}
        if costs is None or len(tiers) != 1 or None in tiers:
            return
        blocks = sum(len(plan.keys) for plan in plans)
        costs.observe_restore(tiers.pop(), blocks * self.store.block_nbytes, seconds)

    def step_started(self, loads: bool) -> None:
        """The forward is about to run; a step with loads is not a pure compute figure."""
        self._step_start = None if loads else time.perf_counter()

    def step_ended(self, meta, busy: bool) -> None:
        """The forward ended (``busy``: async loads were running beside it: not observed)."""
        start, self._step_start = self._step_start, None
        costs = self.costs
        tokens = getattr(meta, "step_tokens", 0)
        if start is None or costs is None or not tokens or busy:
            return
        costs.observe_step(tokens, getattr(meta, "step_attention", 0), time.perf_counter() - start)
