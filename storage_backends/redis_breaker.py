"""The Redis tier's circuit breaker: after a failed call every call fails at once, and one
background probe (every cool-down, doubling from ``COOLDOWN_MIN`` to ``COOLDOWN_MAX`` seconds)
watches for the server to answer again and closes it. No caller ever waits on a probe.

A probe runs under the same whole-call deadline as a call (:mod:`storage_backends.redis_deadline`):
without one, a server trickling its PONG (each read within the socket timeout) closed the breaker
after seconds, and every caller then paid a full timeout again. (A cluster probe's topology read
holds redis-py's topology lock, which a call's own re-read waits on: it is bounded the same way.)

Between pings the probe waits on an event that :meth:`Breaker.close` sets: a probe waiting ends at
once and close() joins it (it slept out its cool-down, up to ``COOLDOWN_MAX``, after the tier had
closed); a probe pinging ends when its ping returns, within the deadline, unwaited for.

A failure whose probe thread cannot be started (``can't start new thread``: a process at its
thread limit, or at interpreter exit) leaves the breaker closed, and the call raises its own
typed error: open, nothing would ever have closed it (every call failed at once for good), and
the RuntimeError escaped the medium's call untyped."""

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
        self._pinging = False  # the probe is inside a ping (not waiting): close() does not wait for it
        self._closed = False
        self._stop = threading.Event()  # set by close(): a probe waiting for its next ping ends

    @property
    def open(self) -> bool:
        return self.failures > 0

    def next_probe_s(self) -> float:
        """Seconds until the next probe."""
        return max(self._retry_at - time.monotonic(), 0.0)

    def trip(self, exc: BaseException) -> None:
        """A call failed: open (or keep open) and make sure one background probe runs (when
        none can be started, leave it closed: see the module docstring)."""
        refused: RuntimeError | None = None
        with self._lock:
            self.failures += 1
            first = self.failures == 1
            if first:
                self._retry_at = time.monotonic() + COOLDOWN_MIN
            if self._prober is None and not self._closed:  # (started here: close() joins no unstarted thread)
                prober = threading.Thread(target=self._probe, name="tiered-kv-redis-probe", daemon=True)
                try:
                    prober.start()  # (it takes the lock before it touches _prober)
                    self._prober = prober
                except RuntimeError as exc_start:  # "can't start new thread": no probe would ever close it
                    refused, self.failures = exc_start, self.failures - 1  # the next call asks the server
        if refused is not None:
            log.warning("redis at %s unavailable: %s; its breaker stays closed: no probe thread could be "
                        "started (%s)", self.where, said(exc), refused)
            return
        log.log(logging.WARNING if first else logging.DEBUG, "redis at %s unavailable: %s", self.where, said(exc))

    def close(self) -> None:
        """Stop probing: a probe waiting for its next ping ends now, joined here; one inside a
        ping ends as the ping returns (within its deadline). Idempotent."""
        with self._lock:
            self._closed = True
            waiting = self._prober if not self._pinging else None
        self._stop.set()
        if waiting is not None and waiting is not threading.current_thread():
            waiting.join()  # (it sees the event at once, or the close before it pings)

    def _probe(self) -> None:
        tries = 0
        while not self._stop.wait(self.next_probe_s()):
            with self._lock:
                if self._closed:
                    break
                self._pinging = True
            try:
                with call_deadline(self._timeout):
                    self._ping()
            except Exception as exc:  # (any: a probe that died would leave the tier down for good)
                if not isinstance(exc, self._down):
                    log.warning("redis at %s: probe failed: %s", self.where, said(exc))
                tries += 1
                with self._lock:
                    self._pinging = False
                    self.failures += 1
                    self._retry_at = time.monotonic() + min(COOLDOWN_MAX, COOLDOWN_MIN * 2 ** tries)
                continue
            with self._lock:
                down, self.failures, self._prober, self._pinging = self.failures, 0, None, False
            log.warning("redis at %s is back after %d failed call(s)", self.where, down)
            return
        with self._lock:
            self._prober, self._pinging = None, False


def said(exc: BaseException) -> str:
    """``exc`` for a log line: its type and message (redis-py 8's repr is its type alone,
    ``auth:AuthenticationError``: a refused password was logged without the server's answer)."""
    return f"{type(exc).__name__}: {exc}"
