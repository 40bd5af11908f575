"""The Redis tier's circuit breaker: after a failed call every call fails at once, and one
background probe (every cool-down, doubling from ``COOLDOWN_MIN`` to ``COOLDOWN_MAX`` seconds)
watches for the server to answer again and closes it. No caller ever waits on a probe.

A probe runs under the same whole-call deadline as a call (:mod:`storage_backends.redis_deadline`):
without one, a server trickling its PONG (each read within the socket timeout) closed the breaker
after seconds, and every caller then paid a full timeout again. (A cluster probe's topology read
holds redis-py's topology lock, which a call's own re-read waits on: it is bounded the same way.)"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from storage_backends.redis_deadline import call_deadline

log = logging.getLogger(__name__)

COOLDOWN_MIN, COOLDOWN_MAX = 0.5, 4.0  # seconds the breaker stays open, doubling per failure


class Breaker:
    """Open after a failure until ``ping`` (run on the probe's thread; raising ``down`` errors
    while the server is away) succeeds, within a deadline of ``timeout`` (None: the socket's own).
    ``where`` names the server in logs (no secrets)."""

    def __init__(self, where: str, ping: Callable[[], object], down: tuple[type[BaseException], ...],
                 timeout: float | None = None) -> None:
        self.where, self._ping, self._down, self._timeout = where, ping, down, timeout
        self._lock = threading.Lock()
        self.failures = 0  # consecutive failed calls and probes; > 0: open
        self._retry_at = 0.0  # when the probe pings next
        self._prober: threading.Thread | None = None  # the background probe while open
        self._closed = False

    @property
    def open(self) -> bool:
        return self.failures > 0

    def next_probe_s(self) -> float:
        """Seconds until the next probe."""
        return max(self._retry_at - time.monotonic(), 0.0)

    def trip(self, exc: BaseException) -> None:
        """A call failed: open (or keep open) and make sure one background probe runs."""
        with self._lock:
            self.failures += 1
            first = self.failures == 1
            if first:
                self._retry_at = time.monotonic() + COOLDOWN_MIN
            start = self._prober is None and not self._closed
            if start:
                self._prober = threading.Thread(target=self._probe, name="tiered-kv-redis-probe", daemon=True)
        log.log(logging.WARNING if first else logging.DEBUG, "redis at %s unavailable: %r", self.where, exc)
        if start:
            self._prober.start()  # type: ignore[union-attr]

    def close(self) -> None:
        """Stop probing (a probe sleeping wakes to nothing)."""
        self._closed = True

    def _probe(self) -> None:
        tries = 0
        while not self._closed:
            time.sleep(self.next_probe_s())
            if self._closed:
                break
            try:
                with call_deadline(self._timeout):
                    self._ping()
            except Exception as exc:  # (any: a probe that died would leave the tier down for good)
                if not isinstance(exc, self._down):
                    log.warning("redis at %s: probe failed: %r", self.where, exc)
                tries += 1
                with self._lock:
                    self.failures += 1
                    self._retry_at = time.monotonic() + min(COOLDOWN_MAX, COOLDOWN_MIN * 2 ** tries)
                continue
            with self._lock:
                down, self.failures, self._prober = self.failures, 0, None
            log.warning("redis at %s is back after %d failed call(s)", self.where, down)
            return
        with self._lock:
            self._prober = None
