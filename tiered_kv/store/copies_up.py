"""Copies up: blocks a lower tier served (a Redis or shared-tier hit) written into a tier above
it, as the validated stored bytes they are (a sealed block stays sealed, under its tenant's key).

- They are write-behind: a tracked write (a withdrawal of their keys deletes after it) queued
  within the save budget, so the load that read them does not wait for them.
- Past that budget the restore writes them itself, so a restore larger than the budget still
  warms the tiers above (it waits for that part of their writes), but on a thread of the copy's
  own, waited for at most :data:`COPY_WAIT_S`: a tier that hangs (a stalled network disk, another
  process holding LMDB's writer lock) must not hold the load, and the forward pass waiting on it,
  for as long as it hangs. While such a late write is still running, later copies past the budget
  into that tier are dropped at once (``copies_up_dropped``): a hung tier holds the threads of
  the copies started before it was known to hang, not one more per load. The late write stays a
  tracked write until it ends (a withdrawal still deletes after it).
- A key a copy up is writing into a tier right now is not copied there again (two loads of the
  same blocks, both read before either copy landed, wrote each block twice).
- A copy the store refuses because it is closing is dropped and counted ``copies_up_dropped``
  (it is no save: it was counted ``saves_dropped``, with every save stored).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait

from tiered_kv.store.encoded_tier import EncodedTier
from tiered_kv.store.saving import Saver

log = logging.getLogger(__name__)

COPY_WAIT_S = 1.0  # the longest a restore waits for its own copy up past the write-behind budget


class CopiesUp:
    """Copies up into the tiers above a lower tier, through ``saver`` (tracked writes, the save
    budget, the namespace records)."""

    def __init__(self, saver: Saver) -> None:
        self.saver, self.pool, self.metrics = saver, saver.pool, saver.metrics
        self._lock = threading.Lock()
        self._writing: set[tuple[str, bytes, bytes]] = set()  # (tier, tenant, key) being copied up now
        self._late: dict[str, int] = {}  # tier -> its copies past the budget outliving their wait

    def queue(self, items: list[tuple[bytes, bytes]], tier: EncodedTier, tenant: bytes) -> None:
        """Copy ``items`` (key, validated stored bytes) of ``tenant`` into ``tier`` (see the
        module docstring). Keys the tier holds by the time the copy runs are not written again."""
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
            return self._past_budget(tier, lambda: job(kept), len(kept))

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

    def _past_budget(self, tier: EncodedTier, write: Callable[[], int], blocks: int) -> Future | None:
        """Run ``write`` on a thread of its own and wait for it at most COPY_WAIT_S; its future,
        or None when it was dropped (a late copy into ``tier`` is still running)."""
        with self._lock:
            late = self._late.get(tier.name, 0)
        if late:
            self.metrics.event("copies_up_dropped", blocks)
            return None
        done: Future = Future()

        def run() -> None:
            try:
                done.set_result(write())
            except BaseException as exc:  # (``write`` logs its own failures: nothing expected)
                done.set_exception(exc)

        threading.Thread(target=run, name=f"tiered-kv-copy-up-{tier.name}", daemon=True).start()
        if not wait([done], COPY_WAIT_S).done:
            with self._lock:
                self._late[tier.name] = self._late.get(tier.name, 0) + 1
            log.warning("%s tier: a copy up of %d blocks is still being written after %.1f s; copies up past "
                        "the write-behind budget are dropped until it ends", tier.name, blocks, COPY_WAIT_S)
            done.add_done_callback(lambda _f: self._late_done(tier.name))
        return done

    def _late_done(self, name: str) -> None:
        with self._lock:
            self._late[name] -= 1
