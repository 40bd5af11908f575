"""What segment descriptors need: at most once a second, drop the entries
whose file another process deleted, so its disk space goes once nothing here holds it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TypeVar

PRUNE_EVERY_S = 1.0

H = TypeVar("H")


class Pruning:
    """``due()`` answers True at most once per ``every`` seconds (the first time after that)."""

    def __init__(self, every: float = PRUNE_EVERY_S) -> None:
        self.every = every
        self._last = time.monotonic()

    def due(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.every:
            return False
        self._last = now
        return True


def forget_gone(entries: Iterable[tuple[int, H]], gone: Callable[[int, H], bool],
                forget: Callable[[int], None]) -> None:
    """``forget(segment)`` for each ``(segment, handle)`` whose file ``gone(segment, handle)``
    says is deleted (an OSError asking counts as deleted)."""
    for segment, handle in entries:
        try:
            dead = gone(segment, handle)
        except OSError:
            dead = True
        if dead:
            forget(segment)
