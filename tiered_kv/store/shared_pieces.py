"""Work shared by the threads of one synchronous load: its blocks handed out in pieces, each take
about a ``2 x threads``-th of what is left and never less than ``least`` (guided
self-scheduling). The first pieces are large, so a piece's fixed cost (a read call, its
transaction, its bookkeeping) is paid a few times per thread; the last are small, so the threads
finish together: one that started late, or ran slower, simply takes fewer. A fixed split (one
equal share per thread) kept the faster thread idle for a tenth of a restore here, and made the
whole load wait for a thread that had not started. No torch here."""

from __future__ import annotations

import threading


class SharedPieces:
    """The indices ``0 .. count - 1`` handed out in ascending, disjoint pieces (:meth:`take`) to
    ``threads`` threads; every index exactly once."""

    def __init__(self, count: int, threads: int, least: int = 1) -> None:
        if count < 0 or threads < 1 or least < 1:
            raise ValueError(f"count {count}, threads {threads}, least {least}")
        self.count, self.threads, self.least = count, threads, least
        self._next = 0
        self._lock = threading.Lock()

    def take(self) -> range | None:
        """The next piece, or None when every index was handed out."""
        with self._lock:
            left = self.count - self._next
            if left <= 0:
                return None
            n = min(left, max(self.least, -(-left // (2 * self.threads))))
            start, self._next = self._next, self._next + n
        return range(start, start + n)
