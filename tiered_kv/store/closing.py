"""Closing a store within ``close_timeout``: a tier that hangs must not hang the engine's shutdown.

:meth:`TieredStore.close` waits for the write-behind queued and the copies up past the budget,
writes the cost estimates, makes the lower tiers durable and tries failed deletes a last time:
each a call into a tier that may not answer (another process holding LMDB's writer lock, which
LMDB waits for without bound; a stalled network disk; a hung NFS mount). That flush runs on a
thread of its own, waited for at most ``close_timeout`` seconds; past it the close gives up:

- the queued writes not started fail (``StoreClosed``) and never run; those running are left to
  their threads (daemons: they end with the process, or land if their tier answers first). The
  blocks of both are counted ``saves_abandoned``, and one warning says how many, and which tiers
  are left open;
- a medium some other thread is still inside (a frame of a method of it, or of its tier, on that
  thread's stack; the flush says which tier it entered) is not closed: closing an LMDB
  environment with a transaction in flight is undefined behaviour in LMDB (the LMDB medium's
  close waits for it, for ever), closing a file store under a write frees the descriptor it uses.
  Such a medium is closed by a thread of its own once what was inside it ended (the tier
  answered again: an LMDB environment left open could not be opened again in this process), or
  left to the process's exit. The others are closed on a thread waited for at most
  ``close_timeout`` again (so a close returns within about twice ``close_timeout``), and the
  pool, the host tier and its slots are closed as always.

When the flush ended in time, the close is the old one: every medium closed, the flush's error
raised. ``close_timeout = None`` waits for ever. An explicit ``flush()`` keeps its meaning (it
waits for every write, or for its own timeout, and closes nothing).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from types import CodeType
from typing import Any

from tiered_kv.store.encoded_tier import EncodedTier
from tiered_kv.store.flushing import drain_writes, flush_tiers
from tiered_kv.store.transfer import Unfinished

log = logging.getLogger(__name__)


def close_store(store: Any, timeout: float | None) -> None:
    """Flush and close the parts of ``store`` (a TieredStore already marked closed), waiting
    for its tiers at most ``timeout`` seconds (None: for ever); see the module docstring."""
    end = None if timeout is None else time.monotonic() + timeout
    flush = _Flush(store)
    finished = flush.run_within(timeout)
    busy = set() if finished else flush.give_up()
    try:
        if store._metrics_ports:
            from tiered_kv.store.prometheus import unexport

            unexport(store)
        store.presence.close()
    finally:
        left = store.pool.close(_left(end))
        copying = not store.loader.reader.copies.drain(0)
        if timeout is None or (finished and not left.running and not copying):
            close_parts(store)
        else:  # (a write queued after the flush may hang too)
            busy |= tiers_in_use(store.tiers)
            _report(store, timeout, left, copying, busy)
            close_parts(store, keep=busy, wait=timeout)
            _close_later(store, flush, busy)
    if finished and flush.error is not None:  # (one given up on may still fail later: not ours to raise)
        raise flush.error


def close_parts(store: Any, media: Sequence = (), keep: Iterable[str] = (), wait: float | None = None) -> None:
    """Stop the pool and close every medium (also when starting a later part of ``store``
    failed; ``media``: those opened before their tiers were made) but the tiers named in
    ``keep``, waiting for the media at most ``wait`` seconds (None: inline, for ever)."""
    store.pool.close()
    if hasattr(store, "copier"):
        store.copier.close()
    tiers = getattr(store, "tiers", None)
    kept = set(keep)
    backends = media if tiers is None else [t.backend for t in tiers if t.name not in kept]
    _close_media(backends, wait)
    if hasattr(store, "slots"):
        store.slots.close()
    if hasattr(store, "host"):
        store.host.close()


def _close_media(backends: Sequence, wait: float | None) -> None:
    def run() -> None:
        for backend in backends:
            try:  # (one medium failing to close left the others, the slots and the host open)
                backend.close()
            except Exception as exc:
                log.warning("%s: closing failed: %s", backend.url, exc)

    if wait is None or not backends:
        run()
        return
    thread = threading.Thread(target=run, name="tiered-kv-close", daemon=True)
    try:
        thread.start()
    except RuntimeError:  # ("can't start new thread")
        run()
        return
    thread.join(wait)
    if thread.is_alive():
        log.warning("closing the store: a lower tier was still closing after %.3g s; it goes on "
                    "in the background", wait)


def _close_later(store: Any, flush: _Flush, kept: set[str]) -> None:
    """Close the media left open once what was inside them ended (a tier that answers again):
    left open for good, an LMDB environment could not be opened again in this process (py-lmdb
    refuses a second open), so an engine re-creating its store after a hang could not."""
    backends = [t.backend for t in store.tiers if t.name in kept]
    if not backends:
        return

    def run() -> None:
        flush._done.wait()
        store.pool.drain(None)
        store.loader.reader.copies.drain(None)
        _close_media(backends, None)

    try:
        threading.Thread(target=run, name="tiered-kv-close-later", daemon=True).start()
    except RuntimeError:  # ("can't start new thread": they stay open until the process exits)
        log.warning("closing the store: no thread to close the tiers left open later")


class _Flush:
    """The closing store's flush, on a thread of its own: which tiers it is inside, and no
    step more once the close gave up on it."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._gave_up = False
        self._inside: set[str] = set()  # the tiers the flush's step now is in
        self._done = threading.Event()

    def run_within(self, timeout: float | None) -> bool:
        """Run the flush, waiting at most ``timeout`` seconds; whether it ended."""
        if timeout is None:
            self._run(None)
            return True
        thread = threading.Thread(target=self._run, args=(None,), name="tiered-kv-close-flush", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:  # here, then: its waits for the pool are bounded
            log.warning("closing the store: no thread for its flush (%s); flushing here", exc)
            self._run(timeout)
        return self._done.wait(timeout) and not self._gave_up

    def give_up(self) -> set[str]:
        """Take no step more; the tiers the step running now is inside."""
        with self._lock:
            self._gave_up = True
            return set(self._inside)

    def _enter(self, names: Iterable[str]) -> bool:
        with self._lock:
            self._inside = set(names)
            return not self._gave_up

    def _run(self, drain: float | None) -> None:
        store = self.store
        names = [t.name for t in store.tiers]
        try:
            if not drain_writes(store.pool, store.loader.reader.copies, drain):
                self.give_up()  # (``drain`` given: no thread for the flush, the pool still busy)
            elif self._enter(names):
                store.cost_record.save()
                flush_tiers(store.tiers, lambda tier: self._enter([tier.name]))
        except BaseException as exc:
            self.error = exc
        try:
            if self._enter(names):  # (after the flush: a failed delete's last retry may have run)
                store.invalidations.close()
        except BaseException as exc:
            self.error = self.error or exc
        finally:
            self._enter(())
            self._done.set()


def tiers_in_use(tiers: Sequence[EncodedTier]) -> set[str]:
    """The names of the ``tiers`` some other thread is inside now: a frame of a method of the
    tier, or of its medium, called on them, on that thread's stack."""
    owners = {id(o): t.name for t in tiers for o in (t, t.backend)}
    codes = _method_codes({type(o) for t in tiers for o in (t, t.backend)})
    me, found = threading.get_ident(), set()
    for ident, frame in sys._current_frames().items():
        while frame is not None and ident != me:
            if frame.f_code in codes and (name := owners.get(id(frame.f_locals.get("self")))):
                found.add(name)
            frame = frame.f_back
    return found


def _method_codes(classes: Iterable[type]) -> set[CodeType]:
    """The code of every function defined on ``classes`` and their bases (decorated ones too)."""
    codes: set[CodeType] = set()
    for cls in classes:
        for base in cls.__mro__:
            for value in vars(base).values():
                for fn in (getattr(value, "__func__", value), getattr(value, "fget", None)):
                    while fn is not None:
                        if isinstance(getattr(fn, "__code__", None), CodeType):
                            codes.add(fn.__code__)
                        fn = getattr(fn, "__wrapped__", None)
    return codes


def _report(store: Any, timeout: float, left: Unfinished, copying: bool, busy: set[str]) -> None:
    """Count the write-behind given up on (``saves_abandoned``, in blocks) and say it once."""
    blocks = (left.failed_save_bytes + left.running_save_bytes) // store.block_nbytes
    if blocks:
        store.metrics.event("saves_abandoned", blocks)
    log.warning("closing the store: its lower tiers did not finish within close_timeout %.3g s: "
                "%d blocks of write-behind abandoned (%d jobs not started, %d still running%s); "
                "left open until what is inside them ends: %s", timeout, blocks, left.failed,
                left.running, ", copies up past the budget still running" if copying else "",
                ", ".join(sorted(busy)) or "none")


def _left(end: float | None) -> float | None:
    return None if end is None else max(0.0, end - time.monotonic())
