"""Withdrawing stored copies that may be wrong, in order with the writes of the same keys.

When a block fails to load, KV computed over it in that step may already have been saved (by
another tensor-parallel rank, whose own loads succeeded; or before anyone knew). The scheduler
then names the keys computed over the failed block, and every rank withdraws its copies:

- at once, the keys are *suppressed*: lookups and lower-tier loads treat them as absent, and
  the host tier retires its copies (a copy leased by a load in flight stays readable to that
  load only; one reserved and still being filled is never published), in one step with the
  delete being registered, so no write can take a host copy between the two;
- a delete job removes them from the lower tiers after every write of those keys already in
  flight (else an older, wrong copy could land after the delete);
- a write from the host tier submitted meanwhile (the recomputed KV, saved after the withdrawal)
  runs after the delete, and skips any key whose host copy was retired (bytes taken before the
  withdrawal); a copy of bytes taken earlier (an evicted block, one just loaded) is not made
  while a withdrawal of its key is in flight, nor one of evicted bytes whose key was withdrawn
  after the eviction took them (the host tier remembers that until its hook has run: the
  withdrawal may have ended before the hook queued the copy);
- when the delete is done the keys are no longer suppressed; but a key a tier failed to delete
  (Redis down, its circuit breaker open) stays suppressed until a retry has deleted it
  (:mod:`tiered_kv.store.tier_deletes`): the wrong copy would otherwise load as good once the
  tier answers again.

Deletes are rare (only after a failed load) and never dropped for the save budget.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future

from storage_backends.host import HostBackend
from tiered_kv.store.encoded_tier import EncodedTier
from tiered_kv.store.futures import WriteFuture, after
from tiered_kv.store.metrics import StoreMetrics
from tiered_kv.store.tier_deletes import TierDeletes
from tiered_kv.store.transfer import TransferPool

log = logging.getLogger(__name__)


class Invalidations:
    """Suppressed keys, deletes in flight and writes in flight, per key."""

    def __init__(self, host: HostBackend, tiers: list[EncodedTier], pool: TransferPool,
                 metrics: StoreMetrics) -> None:
        self.host, self.tiers, self.pool, self.metrics = host, tiers, pool, metrics
        self._lock = threading.Lock()
        self._suppressed: Counter[bytes] = Counter()  # key -> invalidations not finished
        self._writes: dict[bytes, list[Future]] = {}  # key -> its writes in flight (write-behind, copies up)
        self._deletes: dict[bytes, Future] = {}  # key -> its delete in flight
        # the lower tiers' deletes; a key one failed to delete stays suppressed until a retry has
        self.deletes = TierDeletes(tiers, pool, metrics, hold=self._hold, release=self._release)

    # -- what others ask -----------------------------------------------------------------------
    def suppressed(self, keys: Sequence[bytes]) -> list[bool]:
        if not self._suppressed:  # the common case: nothing is being withdrawn
            return [False] * len(keys)
        with self._lock:
            return [k in self._suppressed for k in keys]

    def begin_write(self, keys: Sequence[bytes], fut: Future, *, replacement: bool) -> tuple[list[bytes], list[Future]]:
        """Register ``fut`` as the write in flight of ``keys`` (a withdrawal from now on deletes
        after it), in one step with asking which deletes it must follow: (the keys to write, the
        deletes in flight of them). A ``replacement`` (a write from the host tier, which skips
        retired copies itself) writes every key after those deletes; a copy of bytes taken
        earlier leaves out the keys being withdrawn."""
        keys = list(keys)
        with self._lock:
            if replacement:
                deletes = list({id(f): f for k in keys if (f := self._deletes.get(k)) is not None}.values())
            else:  # (and those withdrawn after an eviction took their bytes: the host knows)
                late = self.host.withdrawn_in_eviction(keys)
                keys = [k for k, w in zip(keys, late) if not w and k not in self._deletes and k not in self._suppressed]
                deletes = []
            for k in keys:
                self._writes.setdefault(k, []).append(fut)
        self._forget_when_done(keys, fut)
        return keys, deletes

    def track_write(self, keys: Sequence[bytes], fut: Future) -> None:
        """Remember ``fut`` as the write in flight of ``keys`` until it is done."""
        keys = list(keys)
        with self._lock:
            for k in keys:
                self._writes.setdefault(k, []).append(fut)
        self._forget_when_done(keys, fut)

    def _forget_when_done(self, keys: list[bytes], fut: Future) -> None:
        """Drop ``fut`` from the writes in flight of ``keys`` once it is done."""

        def done(finished: Future) -> None:  # (not ``fut``: a callback naming its own future is a
            # reference cycle, two a load call, left to the cyclic GC, whose full collections
            # stopped a warm restore for ~70 ms)
            with self._lock:
                for k in keys:
                    writes = self._writes.get(k)
                    if writes is not None and finished in writes:
                        writes.remove(finished)
                        if not writes:
                            del self._writes[k]

        fut.add_done_callback(done)

    def _hold(self, keys: list[bytes]) -> None:
        with self._lock:
            self._suppressed.update(keys)

    def _release(self, keys: list[bytes]) -> None:
        with self._lock:
            self._suppressed.subtract(keys)
            self._suppressed += Counter()  # drop keys whose count reached zero

    # -- withdrawing ---------------------------------------------------------------------------
    def invalidate(self, keys: Sequence[bytes]) -> Future:
        """Withdraw every copy of ``keys`` (see the module docstring); done when the lower tiers
        no longer hold them, or those that failed to delete them keep them withdrawn here until
        a retry has."""
        keys = list(dict.fromkeys(keys))
        out: Future = WriteFuture()  # (cancelled, the writes after it would run before the delete)
        if not keys:
            out.set_result(0)
            return out
        with self._lock:  # (then the host's lock: never taken the other way round)
            self._suppressed.update(keys)
            earlier = list({id(f): f for k in keys for f in self._writes.get(k, ())}.values())
            for k in keys:
                self._deletes[k] = out
            self.host.retire_many(keys)
        self.metrics.event("blocks_invalidated", len(keys))

        def finish(_f: Future | None = None) -> None:
            self._release(keys)
            with self._lock:
                for k in keys:
                    if self._deletes.get(k) is out:
                        del self._deletes[k]
            if not out.done():
                out.set_result(len(keys))

        def start() -> None:
            try:
                self.pool.submit_save(0, lambda: self.deletes.delete({tier.name: keys for tier in self.tiers})
                                      ).add_done_callback(finish)
            except RuntimeError:  # the pool is closed: nothing more will be written either
                log.warning("%d possibly wrong blocks not deleted: the store is closing", len(keys))
                finish()

        after(earlier, start)
        return out

    def close(self) -> None:
        """Try failed deletes a last time and stop retrying (the store is closing)."""
        self.deletes.close()
