"""Copies up: blocks a lower tier served (a Redis or shared-tier hit) written into a tier above
it, as the validated stored bytes they are (a sealed block stays sealed, under its tenant's key).

- They are write-behind: a tracked write (a withdrawal of their keys deletes after it) queued
  within the save budget, so the load that read them does not wait for them.
- Past that budget the restore writes them itself, so a restore larger than the budget still
  warms the tiers above (it waits for that part of their writes), but on a thread of the copy's
  own, waited for at most :data:`COPY_WAIT_S` over the whole restore (:class:`CopyWait`, shared
  by its copies into every tier: each waited its own second, and a restore below two hung tiers
  waited two): a tier that hangs (a stalled network disk, another process holding LMDB's writer
  lock) must not hold the load, and the forward pass waiting on it, for as long as it hangs.
  One such copy per tier runs at a time: while it runs (waited for, or late), other copies past
  the budget into that tier are dropped at once (``copies_up_dropped``), decided under the lock
  that claims the tier (checked apart, two restores both started one into a hung tier). A hung
  tier holds one thread, not one more per load. The write stays a tracked write until it ends
  (a withdrawal still deletes after it), and :meth:`CopiesUp.drain` waits for it (a flush that
  returned True with a late copy still to be written reported writes done that were not, and a
  close after it lost that copy).
- A key a copy up is writing into a tier right now is not copied there again (two loads of the
  same blocks, both read before either copy landed, wrote each block twice).
- A copy the store refuses because it is closing is dropped and counted ``copies_up_dropped``
  (it is no save: it was counted ``saves_dropped``, with every save stored).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait

from tiered_kv.store.encoded_tier import EncodedTier
from tiered_kv.store.saving import Saver

log = logging.getLogger(__name__)

COPY_WAIT_S = 1.0  # the longest a restore waits for its own copies up past the write-behind budget
_now = time.monotonic  # (CopyWait's clock)


class CopiesUp:
    """Copies up into the tiers above a lower tier, through ``saver`` (tracked writes, the save
    budget, the namespace records)."""

    def __init__(self, saver: Saver) -> None:
        self.saver, self.pool, self.metrics = saver, saver.pool, saver.metrics
        self._lock = threading.Condition()  # (notified as a copy past the budget ends)
        self._writing: set[tuple[str, bytes, bytes]] = set()  # (tier, tenant, key) being copied up now
        self._own: dict[str, Future] = {}  # tier -> its copy past the budget (on a thread of its own)

    def queue(self, items: list[tuple[bytes, bytes]], tier: EncodedTier, tenant: bytes,
              waited: CopyWait | None = None) -> None:
        """Copy ``items`` (key, validated stored bytes) of ``tenant`` into ``tier`` (see the
        module docstring). Keys the tier holds by the time the copy runs are not written again.
        ``waited``: the restore's wait for its copies past the budget (None: one of its own)."""
        waited = CopyWait() if waited is None else waited
        with self._lock:
            items = [(k, b) for k, b in items if (tier.name, tenant, k) not in self._writing]
            claimed = {(tier.name, tenant, k) for k, _ in items}
            self._writing |= claimed
        if not items:
            return
        stored = dict(items)

        def job(kept: list[bytes]) -> int:
            try:
                todo = [k for k, held in zip(kept, tier.contains(kept)) if not held]
                if not todo:
                    return 0
                self.saver.records.keep(tier)
                return sum(tier.put_blobs([(k, stored[k]) for k in todo], len(todo) * self.saver.block_nbytes,
                                          tenant=tenant))
            except Exception:  # the blocks were loaded; only their copy up there is lost
                log.exception("copy of %d blocks into the %s tier failed", len(kept), tier.name)
                return 0

        def refused(kept: list[bytes]) -> Future | None:  # the write-behind budget is spent
            if self.pool.closed:
                self.metrics.event("copies_up_dropped", len(kept))
                return None
            return self._past_budget(tier, lambda: job(kept), len(kept), waited)

        try:
            out = self.saver.submit_write(list(stored), job, refused, replacement=False)
        except BaseException:
            self._release(claimed)
            raise
        if out is None:
            self._release(claimed)
        else:
            out.add_done_callback(lambda _f: self._release(claimed))

    def _release(self, claimed: set[tuple[str, bytes, bytes]]) -> None:
        with self._lock:
            self._writing -= claimed

    def _past_budget(self, tier: EncodedTier, write: Callable[[], int], blocks: int,
                     waited: CopyWait) -> Future | None:
        """Run ``write`` on a thread of its own and wait for it at most what ``waited`` has
        left; its future, or None when it was dropped (a copy past the budget into ``tier`` is
        running, or no thread could be started)."""
        done: Future = Future()
        with self._lock:
            running = self._own.get(tier.name)
            claimed = running is None or running.done()  # (done: its callback has not run yet)
            if claimed:
                self._own[tier.name] = done
        if not claimed:
            self.metrics.event("copies_up_dropped", blocks)
            return None

        def run() -> None:
            try:
                done.set_result(write())
            except BaseException as exc:  # (``write`` logs its own failures: nothing expected)
                done.set_exception(exc)

        done.add_done_callback(lambda _f: self._ended(tier.name, done))
        try:
            threading.Thread(target=run, name=f"tiered-kv-copy-up-{tier.name}", daemon=True).start()
        except RuntimeError as exc:  # ("can't start new thread"): the blocks were loaded all the same
            log.warning("%s tier: a copy up of %d blocks is dropped: %s", tier.name, blocks, exc)
            done.set_result(0)
            self.metrics.event("copies_up_dropped", blocks)
            return None
        if not wait([done], waited.left()).done:
            log.warning("%s tier: a copy up of %d blocks is still being written after %.1f s; copies up past "
                        "the write-behind budget are dropped until it ends", tier.name, blocks, COPY_WAIT_S)
        return done

    def _ended(self, name: str, done: Future) -> None:
        with self._lock:
            if self._own.get(name) is done:
                del self._own[name]
            self._lock.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no copy past the budget is being written (False: one still is after
        ``timeout`` seconds)."""
        with self._lock:
            return self._lock.wait_for(lambda: all(f.done() for f in self._own.values()), timeout)


class CopyWait:
    """What one restore waits for its copies past the budget, into every tier together:
    :data:`COPY_WAIT_S` from the first of them on."""

    def __init__(self) -> None:
        self._end: float | None = None

    def left(self) -> float:
        now = _now()
        if self._end is None:
            self._end = now + COPY_WAIT_S
        return max(0.0, self._end - now)
