"""Deleting withdrawn keys from the lower tiers, and trying again where a tier refused.

A withdrawal (:mod:`tiered_kv.store.invalidation`) deletes its keys from every lower tier. A tier
that fails to (Redis down, its circuit breaker open; a full disk) may still hold a wrong copy,
which would load as good once the tier answers again; so its keys stay *held* (the withdrawal
keeps them suppressed) and their delete is tried again after 0.5 s, doubling to 30 s, by one
timer for all such keys, until that tier has deleted them. A failure is counted once per
withdrawal; a tier refusing for good is warned about once a minute. At close the deletes left
are tried a last time and what is still left is logged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

from storage_backends.log_throttle import LogThrottle
from tiered_kv.store.encoded_tier import EncodedTier
from tiered_kv.store.metrics import StoreMetrics
from tiered_kv.store.transfer import TransferPool

log = logging.getLogger(__name__)

RETRY_FIRST_S, RETRY_MAX_S = 0.5, 30.0  # waits before failed deletes are tried again (doubling)

Failures = dict[bytes, dict[str, int]]  # key -> {tier name: failure number}


class TierDeletes:
    """Deletes from the lower tiers; keys a tier failed to delete are held (``hold(keys)``,
    once per key) until every such tier deleted them (``release(keys)``)."""

    def __init__(self, tiers: list[EncodedTier], pool: TransferPool, metrics: StoreMetrics, *,
                 hold: Callable[[list[bytes]], None], release: Callable[[list[bytes]], None]) -> None:
        self.tiers, self.pool, self.metrics = tiers, pool, metrics
        self._hold, self._release = hold, release
        self._lock = threading.Lock()  # (taken before the withdrawal's: never the other way round)
        self._undeleted: Failures = {}  # the failures not yet deleted since (a retry checks the number)
        self._failures = 0
        self._retry: threading.Timer | None = None
        self._wait = RETRY_FIRST_S
        self._closed = False
        self._said = LogThrottle(log)

    def delete(self, todo: dict[str, list[bytes]], failed: Failures | None = None) -> None:
        """Delete ``todo`` (tier name -> keys); ``failed``: the failures a retry deletes again
        (those that happened again meanwhile stay)."""
        for tier in self.tiers:
            keys = todo.get(tier.name)
            if not keys:
                continue
            try:
                tier.backend.delete_many([tier.ns + k for k in keys])
            except Exception as exc:  # (any failure: a medium's untyped one must not end the withdrawal)
                if failed is None:  # counted once per withdrawal, not per retry
                    self.metrics.event(f"{tier.name}_invalidate_failed", len(keys))
                self._said.warning("%s tier: %d possibly wrong blocks not deleted (tried again later): %s",
                                   tier.name, len(keys), exc)
                self._undeletable(tier.name, keys)
                continue
            if failed is not None:
                self._deleted(tier.name, keys, failed)

    def _undeletable(self, tier: str, keys: list[bytes]) -> None:
        with self._lock:
            self._failures += 1
            if fresh := [k for k in keys if k not in self._undeleted]:
                self._hold(fresh)
            for k in keys:
                self._undeleted.setdefault(k, {})[tier] = self._failures
            if self._retry is None and not self._closed:
                self._arm()

    def _deleted(self, tier: str, keys: list[bytes], failed: Failures) -> None:
        done = []
        with self._lock:
            for k in keys:
                tiers = self._undeleted.get(k)
                if tiers is not None and tiers.get(tier) == failed[k][tier]:  # (not failed again since)
                    del tiers[tier]
                    if not tiers:
                        del self._undeleted[k]
                        done.append(k)
            if done:
                self._release(done)

    def _arm(self) -> None:  # (under the lock)
        self._retry = threading.Timer(self._wait, self._submit_retry)
        self._retry.daemon = True
        self._retry.start()

    def _failed(self) -> tuple[dict[str, list[bytes]], Failures]:
        """(tier name -> keys it failed to delete, the failures as they are now); under the lock."""
        failed = {k: dict(tiers) for k, tiers in self._undeleted.items()}
        todo: dict[str, list[bytes]] = {}
        for k, tiers in failed.items():
            for name in tiers:
                todo.setdefault(name, []).append(k)
        return todo, failed

    def _submit_retry(self) -> None:
        """Delete again what tiers failed to delete (on the pool: deletes are writes)."""
        with self._lock:
            if self._closed:
                return
            todo, failed = self._failed()
            self._wait = min(self._wait * 2, RETRY_MAX_S)

        def retried(_f: Future) -> None:
            with self._lock:
                self._retry = None
                if not self._undeleted:
                    self._wait = RETRY_FIRST_S
                elif not self._closed:
                    self._arm()

        try:
            self.pool.submit_save(0, lambda: self.delete(todo, failed)).add_done_callback(retried)
        except RuntimeError:  # the pool is closed (and so is the store: :meth:`close` said what is left)
            with self._lock:
                self._retry = None

    def close(self) -> None:
        """Try failed deletes a last time, on this thread, and stop retrying."""
        with self._lock:
            self._closed = True
            retry, self._retry = self._retry, None
            todo, failed = self._failed()
        if retry is not None:
            retry.cancel()
        if failed:
            self.delete(todo, failed)
        if self._undeleted:
            log.warning("%d possibly wrong blocks left undeleted in a lower tier: the store closed "
                        "before the tier took their deletes", len(self._undeleted))
