"""Warnings that repeat on every call while a condition lasts (a full disk, a failing device),
logged at most once per interval with a count of the ones held back."""

from __future__ import annotations

import logging
import threading
import time


class LogThrottle:
    """``warning(...)`` like a logger's, but at most once per ``interval`` seconds."""

    def __init__(self, logger: logging.Logger, interval: float = 60.0) -> None:
        self.logger, self.interval = logger, interval
        self._lock = threading.Lock()
        self._next = 0.0  # monotonic time of the next warning let through
        self._held = 0  # warnings held back since the last one logged

    def warning(self, msg: str, *args: object) -> bool:
        """Log now if the interval has passed (with the count held back); whether it logged."""
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self._held += 1
                return False
            held, self._held, self._next = self._held, 0, now + self.interval
        if held:
            msg += " (%d similar warnings in the last %.0f s not shown)"
            args = (*args, held, self.interval)
        self.logger.warning(msg, *args)
        return True
