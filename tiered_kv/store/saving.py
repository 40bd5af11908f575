"""The save path of the tiered store: two-phase saves into the host tier, then write-behind
to the lower tiers (``write_through`` at once, ``on_evict`` when the host tier evicts), with the
namespace record kept next to the blocks."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from storage_backends.host import HostBackend
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import BackendError
from tiered_kv.store.futures import after, gather
from tiered_kv.store.invalidation import Invalidations
from tiered_kv.keys import Namespace
from tiered_kv.store.metrics import StoreMetrics
from tiered_kv.store.records import encode_namespace, namespace_key
from tiered_kv.store.encoded_tier import EncodedTier
from tiered_kv.store.transfer import TransferPool

log = logging.getLogger(__name__)

SAVE_CHUNK_BYTES = 16 << 20  # write-behind job size: enough blocks to amortise a txn
RECORD_CHECK_S = 60.0  # how often the write path re-checks a tier's namespace record


@dataclass
class SaveBatch:
    """Phase one of a save: host slots reserved for ``keys`` (others were skipped)."""

    keys: list[bytes]
    slots: list[int]
    skipped: int = 0  # keys already stored in the host tier or without room


class SavePath:
    """Saving into a :class:`tiered_kv.store.TieredStore` (a mixin: the store sets the
    attributes below; ``copy_blocks`` comes from :class:`SlotViews`)."""

    config: TieredKVConfig
    namespace: Namespace
    host: HostBackend
    lower: list[EncodedTier]
    pool: TransferPool
    metrics: StoreMetrics
    block_nbytes: int
    _slot_rows: np.ndarray
    _record_due: dict[str, float]
    invalidations: Invalidations

    def prepare_save(self, keys: Sequence[bytes]) -> SaveBatch:
        """Phase one: reserve host slots for the keys not stored yet."""
        slots = self.host.reserve_many(list(keys))
        kept = [(k, s) for k, s in zip(keys, slots) if s is not None]
        skipped = len(keys) - len(kept)
        if skipped:
            present = sum(self.host.contains_many([k for k, s in zip(keys, slots) if s is None]))
            if skipped - present:
                self.metrics.event("saves_no_room", skipped - present)
        return SaveBatch([k for k, _ in kept], [s for _, s in kept], skipped)

    def commit_save(self, batch: SaveBatch, ok: bool = True) -> Future | None:
        """Phase two: publish the filled slots (or roll back) and queue write-behind."""
        if not batch.keys:
            return None
        if not ok:
            self.host.abort_many(batch.keys)
            self.metrics.event("saves_rolled_back", len(batch.keys))
            return None
        self.host.commit_many(batch.keys)
        self.metrics.wrote("host", len(batch.keys), len(batch.keys) * self.block_nbytes,
                           len(batch.keys) * self.block_nbytes, 0.0)
        return self._write_behind(batch.keys)

    def save(self, keys: Sequence[bytes], payloads: Sequence[torch.Tensor]) -> Future | None:
        """Copy ``payloads`` (canonical block tensors) into the host tier and write behind.

        More blocks than the host tier holds at once are staged in chunks; a chunk waits for
        the write-behind of earlier ones when their leased slots are all the room there is."""
        index = {k: i for i, k in enumerate(keys)}
        chunk = max(1, self.host.num_slots // 2)
        futures: list[Future] = []
        for start in range(0, len(keys), chunk):
            part = list(keys[start : start + chunk])
            if futures and not self.host.can_reserve(len(part)):
                for f in futures:
                    f.exception()
            batch = self.prepare_save(part)
            try:
                self.copy_blocks(batch.slots, [payloads[index[k]] for k in batch.keys], into_slots=True)
            except Exception:
                self.commit_save(batch, ok=False)
                raise
            fut = self.commit_save(batch)
            if fut is not None:
                futures.append(fut)
        return gather(futures)

    def _write_behind(self, keys: list[bytes]) -> Future | None:
        targets = [t for t in self.lower if t.policy == "write_through"]
        if not targets:
            return None
        per_job = max(1, min(SAVE_CHUNK_BYTES // self.block_nbytes,
                             -(-len(keys) // self.config.workers)))
        futures = []
        for start in range(0, len(keys), per_job):
            chunk = keys[start : start + per_job]
            slots = self.host.pin_many(chunk)
            pinned = [(k, s) for k, s in zip(chunk, slots) if s is not None]
            if not pinned:
                continue
            fut = self._submit_write(pinned, targets)
            if fut is not None:
                futures.append(fut)
        return gather(futures)

    def _submit_write(self, pinned: list[tuple[bytes, int]], targets: list[EncodedTier]) -> Future | None:
        """Queue the write of ``pinned`` (after any delete in flight of the same keys: that is
        a withdrawn wrong copy, and this is its recomputed replacement); None when dropped."""
        keys = [k for k, _ in pinned]
        deletes = self.invalidations.deletes_of(keys)
        nbytes = len(pinned) * self.block_nbytes
        if not deletes:
            fut = self.pool.try_submit_save(nbytes, lambda: self._write_job(pinned, targets))
            if fut is None:
                self._drop_write(keys)
                return None
            self.invalidations.track_write(keys, fut)
            return fut
        out: Future = Future()
        self.invalidations.track_write(keys, out)

        def start() -> None:
            job = self.pool.try_submit_save(nbytes, lambda: self._write_job(pinned, targets))
            if job is None:
                self._drop_write(keys)
                out.set_result(0)
            else:
                job.add_done_callback(lambda j: out.set_exception(j.exception()) if j.exception()
                                      else out.set_result(j.result()))

        after(deletes, start)
        return out

    def _drop_write(self, keys: list[bytes]) -> None:
        self.host.unpin_many(keys)
        self.metrics.event("saves_dropped", len(keys))

    def _write_job(self, pinned: list[tuple[bytes, int]], targets: list[EncodedTier]) -> int:
        try:
            items = [(k, self.host.slot_view(s, self.block_nbytes).numpy()) for k, s in pinned]
            return self._write_lower(items, targets)
        finally:
            self.host.unpin_many([k for k, _ in pinned])

    def _write_lower(self, items: list[tuple[bytes, object]], targets: list[EncodedTier]) -> int:
        """Encode (once per codec setting) and store ``items`` in each target tier (keys the tier
        holds already are skipped)."""
        stored = 0
        encoded: dict[tuple[str, int], dict[bytes, bytes]] = {}
        for tier in targets:
            have = tier.contains([k for k, _ in items])
            todo = [(k, p) for (k, p), held in zip(items, have) if not held]
            if not todo:
                continue
            self._record_namespace(tier)
            start = time.perf_counter()
            cache = encoded.setdefault((tier.codec.codec, tier.codec.level), {})
            blobs = [(k, cache[k] if k in cache else cache.setdefault(k, tier.encode(k, p)))
                     for k, p in todo]
            stored += sum(tier.put_blobs(blobs, len(todo) * self.block_nbytes, start))
        return stored

    def _record_namespace(self, tier: EncodedTier) -> None:
        """Keep the namespace record (``tiered_kv.store.records``) next to the blocks of ``tier``, for
        tools that report model id and shape per namespace. Checked on the write path (never on
        open: no Redis round trip there), at most every RECORD_CHECK_S, so a record that LRU,
        a TTL or an operator removed comes back."""
        now = time.monotonic()
        if now < self._record_due.get(tier.name, 0.0):
            return
        self._record_due[tier.name] = now + RECORD_CHECK_S
        key = namespace_key(tier.ns)
        try:
            if not tier.backend.contains_many([key])[0]:
                tier.backend.put_many([(key, encode_namespace(self.namespace))])
        except BackendError as exc:  # the blocks' own put reports the outage
            self._record_due[tier.name] = now
            log.debug("%s tier: namespace record not written: %s", tier.name, exc)

    def _on_host_evict(self, key: bytes, value: memoryview) -> None:
        targets = [t for t in self.lower if t.policy == "on_evict"]
        payload = bytes(value)
        fut = self.pool.try_submit_save(len(payload),
                                        lambda: self._write_lower([(key, payload)], targets))
        if fut is None:
            self.metrics.event("saves_dropped")
        else:
            self.invalidations.track_write([key], fut)
