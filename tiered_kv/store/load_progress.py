"""How far each block of a layer-wise load has arrived: the leading payload bytes checked and in
its host slot, the slot it is being decoded into, and whether its load is over (loaded or failed).

The load jobs advance it frame by frame (:meth:`EncodedTier.read_layered`); the connector's
worker waits on it before each layer the engine computes and copies only what it names. A slot
named here stays reserved until the plan is released, also when its block failed: nothing else
is written into it while the worker may still copy its checked bytes out.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class LoadProgress:
    """Progress of the ``n`` blocks of one load plan, blocks of ``full`` payload bytes."""

    def __init__(self, n: int, full: int) -> None:
        self.full = full
        self._cond = threading.Condition()
        self.ready = [0] * n  # leading payload bytes checked and in the slot
        self.slot: list[int | None] = [None] * n  # host slot holding (or receiving) the block
        self.over = [False] * n  # the block's load ended (loaded: ready == full; else failed)

    def hold(self, i: int, slot: int, ready: int = 0) -> None:
        """Block ``i`` is (being) read into host ``slot``; ``ready`` bytes of it already are."""
        with self._cond:
            self.slot[i] = slot
            self.ready[i] = ready
            if ready >= self.full:
                self.over[i] = True
            self._cond.notify_all()

    def advance(self, indices: Iterable[int], ready: int) -> None:
        """The first ``ready`` bytes of blocks ``indices`` are checked and in their slots."""
        with self._cond:
            for i in indices:
                self.ready[i] = max(self.ready[i], ready)
            self._cond.notify_all()

    def end(self, indices: Iterable[int]) -> None:
        """The loads of blocks ``indices`` are over (each either complete or failed)."""
        with self._cond:
            for i in indices:
                self.over[i] = True
            self._cond.notify_all()

    def wait(self, ready: int, timeout: float | None = None) -> bool:
        """Until every block has ``ready`` bytes in place or its load is over; False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: all(o or r >= ready for r, o in zip(self.ready, self.over)), timeout)

    def wait_all(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: all(self.over), timeout)
