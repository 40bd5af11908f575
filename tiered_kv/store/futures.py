"""Small combinators over ``concurrent.futures.Future``: one future for many, and "then"."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future


def gather(futures: list[Future]) -> Future | None:
    """One future that completes when all ``futures`` did (result: sum of their results)."""
    if not futures:
        return None
    if len(futures) == 1:
        return futures[0]
    out: Future = Future()
    futures = list(futures)  # (emptied once all are done: each one's callback names them all, a
    # reference cycle otherwise left to the cyclic GC)
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_f: Future) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            done, futures[:] = futures[:], []
            # (a cancelled one counts as failed: ``exception()`` would raise here, inside a
            # callback, and ``out`` would never complete)
            errors = [CancelledError() if f.cancelled() else f.exception() for f in done
                      if f.cancelled() or f.exception() is not None]
            if errors:
                out.set_exception(errors[0])
            else:
                out.set_result(sum(f.result() or 0 for f in done))

    for f in futures:
        f.add_done_callback(one_done)
    return out


def after(futures: list[Future], fn: Callable[[], None]) -> None:
    """Run ``fn`` once every one of ``futures`` is done (at once when none is pending)."""
    pending = gather([f for f in futures if not f.done()])
    if pending is None:
        fn()
    else:
        pending.add_done_callback(lambda _f: fn())


class WriteFuture(Future):
    """The future of a write the store tracks (a withdrawal of its keys waits for it): it
    cannot be cancelled, since a write no longer tracked could land after such a delete."""

    def cancel(self) -> bool:
        return False


def settle(out: Future, done: Future) -> None:
    """Complete ``out`` as ``done`` completed (a cancelled ``done`` as a CancelledError)."""
    if done.cancelled():
        out.set_exception(CancelledError())
    elif done.exception() is not None:
        out.set_exception(done.exception())
    else:
        out.set_result(done.result())
