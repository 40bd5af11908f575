"""Small combinators over ``concurrent.futures.Future``: one future for many, and "then"."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future


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
            errors = [f.exception() for f in done if f.exception() is not None]
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
