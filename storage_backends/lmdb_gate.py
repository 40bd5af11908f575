"""The remap gate of the LMDB tier: shared for transactions, exclusive for remaps and close."""

from __future__ import annotations

import threading
from contextlib import contextmanager


class RemapGate:
    """Shared for every transaction, exclusive for remaps and close. Re-entrant per thread;
    a waiting exclusive holder blocks new shared holders (no starvation) for at most its
    timeout, so a stuck reader delays a remap but cannot wedge the process."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._owner: int | None = None
        self._waiting = 0
        self._local = threading.local()

    def held(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    @contextmanager
    def shared(self):
        depth = getattr(self._local, "depth", 0)
        first = depth == 0 and self._owner != threading.get_ident()
        if first:
            with self._cond:
                self._cond.wait_for(lambda: self._owner is None and not self._waiting)
                self._shared += 1
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            if first:
                with self._cond:
                    self._shared -= 1
                    self._cond.notify_all()

    @contextmanager
    def paused(self):
        """Hold back new shared holders while the ones inside finish. py-lmdb's abort of a write
        transaction waits until no call of this process is inside LMDB: readers arriving all
        the time would starve it."""
        with self._cond:
            self._waiting += 1
        try:
            yield
        finally:
            with self._cond:
                self._waiting -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self, timeout: float | None):
        """Yields whether the gate was won (False: held shared here, or timed out)."""
        me = threading.get_ident()
        if self._owner == me:
            yield True
            return
        if self.held():
            yield False
            return
        with self._cond:
            self._waiting += 1
            won = self._cond.wait_for(lambda: self._owner is None and not self._shared, timeout)
            self._waiting -= 1
            if won:
                self._owner = me
            self._cond.notify_all()
        try:
            yield won
        finally:
            if won:
                with self._cond:
                    self._owner = None
                    self._cond.notify_all()
