"""Saves whose device->host copy was queued: each is committed to the store once its copy is
done (on CUDA the copy runs on a side stream and its event says when; on CPU it is done at once).

A save reserves the host slots of its keys until it is committed, and a load that wants one of
those keys waits for that commit (the store's loader leases what another reservation publishes).
Only the worker's thread commits, so before a step's loads start, the saves holding a key one
of those loads reads are waited for and committed (:meth:`SaveCopies.commit_ready` with
``needed``): the copy is a device->host copy queued a step ago, while the load's wait would hold
the forward pass until the loader gave up, and then miss.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass

from tiered_kv.store import SaveBatch, TieredStore


@dataclass
class PendingSave:
    batch: SaveBatch
    request_ids: set[str]
    event: object | None = None  # torch.cuda.Event when the copy is asynchronous


class SaveCopies:
    """The worker's saves not committed yet, oldest first."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self._pending: list[PendingSave] = []

    def add(self, batch: SaveBatch, request_ids: set[str], event: object | None = None) -> None:
        self._pending.append(PendingSave(batch, request_ids, event))

    def commit_ready(self, needed: Set[bytes] = frozenset()) -> None:
        """Commit every save whose copy is done, and those holding a key in ``needed`` after
        waiting for their copy."""
        keep = []
        for pending in self._pending:
            event = pending.event
            if event is not None and not event.query():
                if not needed or needed.isdisjoint(pending.batch.keys):
                    keep.append(pending)
                    continue
                event.synchronize()
            self.store.commit_save(pending.batch)
        self._pending = keep

    def busy_requests(self) -> set[str]:
        """Requests with a save not committed yet."""
        return {r for pending in self._pending for r in pending.request_ids}
