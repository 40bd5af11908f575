"""Read accesses of the LMDB tier, buffered in memory until the next write transaction records
them (a read never costs a write of its own)."""

from __future__ import annotations

import threading

Accesses = dict[bytes, tuple[int, int]]  # key -> (last access ns, hits)


class AccessBuffer:
    """Accesses not yet written. With ``record=False`` (tools) it keeps none."""

    def __init__(self, record: bool = True) -> None:
        self.record = record
        self._lock = threading.Lock()
        self._pending: Accesses = {}

    def add(self, keys: list[bytes], now: int) -> int:
        """Record a read of each of ``keys`` at ``now``; how many keys are pending."""
        if not self.record:
            return 0
        with self._lock:
            for key in keys:
                hits = self._pending.get(key, (0, 0))[1]
                self._pending[key] = (now, hits + 1)
            return len(self._pending)

    def take(self) -> Accesses:
        """Every pending access (the buffer is empty afterwards)."""
        with self._lock:
            taken, self._pending = self._pending, {}
        return taken

    def restore(self, taken: Accesses) -> None:
        """Put back what :meth:`take` gave when the transaction that was to record it failed."""
        with self._lock:
            for key, (atime, hits) in taken.items():
                now, more = self._pending.get(key, (0, 0))
                self._pending[key] = (max(atime, now), hits + more)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)
