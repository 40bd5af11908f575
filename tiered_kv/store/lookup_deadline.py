"""A deadline on the scheduler's presence lookups, one tier at a time (no torch here).

The engine's scheduler asks "which of these blocks are stored?" for every waiting request, on
its own thread, every step. A tier that does not answer (a black-holed Redis, a stalled network
disk) must cost that thread a bounded time, not ``timeout x (retries + 1)`` again and again. So a
lookup runs on the tier's own helper thread and the scheduler waits for it at most ``deadline``
seconds; an unanswered tier counts as a miss for that lookup. While a late answer is still
outstanding the tier is skipped at once (a hung tier holds one thread, never a growing pile), and
the late answer is dropped. A lookup asked in parts (:meth:`DeadlineLookup.call_parts`: a long
prompt's keys in order) keeps what the tier answered in time: the leading parts are a usable
answer (a restart with a cold page cache reads LMDB's index from disk: 2048 keys took ~60 ms
there, and a whole-or-nothing answer made a 32k-token prompt recompute); the parts left are
not asked. The helper is a daemon thread (not a ThreadPoolExecutor, whose
workers are joined at exit): a call stuck on a hung tier never holds up the process's exit.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class LookupTimedOut(Exception):
    """The tier did not answer within the deadline (or a late answer is still outstanding)."""


class DeadlineLookup:
    """Runs one tier's lookups on a helper thread and waits at most ``deadline`` seconds."""

    def __init__(self, name: str, deadline: float) -> None:
        self.name = name
        self.deadline = deadline
        self.timeouts = 0  # lookups that found the tier unanswered
        self._lock = threading.Lock()
        self._late: Future | None = None  # a call still running after its caller gave up
        self._work = threading.Condition(self._lock)
        self._jobs: deque[tuple[Callable[[], object], Future]] = deque()
        self._thread: threading.Thread | None = None
        self._closed = False

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the helper thread; its result, or :class:`LookupTimedOut` after the
        deadline. Exceptions of ``fn`` reach the caller unchanged."""
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise LookupTimedOut(f"{self.name}: lookups are closed")
            if self._late is not None and not self._late.done():
                self.timeouts += 1
                raise LookupTimedOut(f"{self.name}: still waiting for an earlier lookup")
            self._late = None
            self._start_thread()
            self._jobs.append((fn, fut))
            self._work.notify()
        try:
            return fut.result(self.deadline)
        except FutureTimeout:
            with self._lock:
                self._late = fut
                self.timeouts += 1
            log.debug("%s tier: lookup unanswered after %.0f ms: counted as a miss", self.name,
                      self.deadline * 1000)
            raise LookupTimedOut(f"{self.name}: no answer within {self.deadline:.3f}s") from None

    def call_parts(self, parts: Sequence[Callable[[], list[T]]]) -> tuple[list[T], bool]:
        """Each of ``parts`` in order on the helper thread, until the deadline: (the results of
        the parts answered, concatenated; whether every part was). The part running at the
        deadline is left to finish (the tier stays skipped until it has); none after it runs.
        Exceptions of a part reach the caller unchanged."""
        done: list[list[T]] = []
        stop = threading.Event()

        def run() -> None:
            for part in parts:
                if stop.is_set():
                    return
                done.append(part())

        try:
            self.call(run)
        except LookupTimedOut:
            stop.set()
            answered = list(done)  # parts appended before the deadline
            return [x for part in answered for x in part], False
        return [x for part in done for x in part], True

    def _start_thread(self) -> None:
        if self._thread is None:
            thread = threading.Thread(target=self._serve, name=f"tiered-kv-lookup-{self.name}", daemon=True)
            # kept only once started: a thread refused ("can't start new thread") and kept anyway
            # left every later job unserved, and the tier skipped as late for good
            thread.start()
            self._thread = thread

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._jobs and not self._closed:
                    self._work.wait()
                if not self._jobs:
                    return
                fn, fut = self._jobs.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the caller (or dropped when it gave up)
                fut.set_exception(exc)

    def close(self) -> None:
        """Stop the helper thread (a call it is stuck in is left to finish on its own)."""
        with self._lock:
            self._closed = True
            self._work.notify()
