"""The save path of the tiered store: two-phase saves into the host tier, then write-behind to
the lower tiers (``write_through`` ones at once, ``on_evict`` ones when the host tier evicts),
each tier taking only the blocks its admission lets in, with the namespace record kept next
to the blocks."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass

import torch

from tiered_kv.errors import BlockMismatch
from tiered_kv.store.admission import RequestCounts
from tiered_kv.store.encoded_tier import EncodedTier
from tiered_kv.store.futures import WriteFuture, after, gather, settle
from tiered_kv.store.host_slots import HostSlots
from tiered_kv.store.invalidation import Invalidations
from tiered_kv.store.metrics import StoreMetrics
from tiered_kv.store.records import RecordKeeper
from tiered_kv.store.transfer import TransferPool

log = logging.getLogger(__name__)

SAVE_CHUNK_BYTES = 16 << 20  # write-behind job size: enough blocks to amortise a txn


@dataclass
class SaveBatch:
    """Phase one of a save: host slots reserved for ``keys`` (others were skipped)."""

    keys: list[bytes]
    slots: list[int]
    skipped: int = 0  # keys already stored in the host tier or without room
    tenant: bytes = b""  # whose blocks these are (quotas, usage)
    counts: list[int] | None = None  # request count of each key (admission)


class _Arena(threading.local):
    """Per-thread encode buffer, grown when a chunk needs more and reused after."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def views(self, count: int, stride: int) -> list[memoryview]:
        if len(self.buf) < count * stride:
            self.buf = bytearray(count * stride)  # zero-filled: every page touched once, here
        whole = memoryview(self.buf)
        return [whole[i * stride : (i + 1) * stride] for i in range(count)]


_arena = _Arena()


class Saver:
    """Saving blocks: handed the host slots, the ordered lower tiers and what moves and counts."""

    def __init__(self, slots: HostSlots, tiers: list[EncodedTier], pool: TransferPool,
                 metrics: StoreMetrics, invalidations: Invalidations, records: RecordKeeper,
                 requests: RequestCounts, workers: int, tenant: bytes) -> None:
        self.slots = slots
        self.host = slots.host
        self.tiers = tiers
        self.written_through = [t for t in tiers if t.policy == "write_through"]  # (asked at every save)
        self.pool = pool
        self.metrics = metrics
        self.invalidations = invalidations
        self.records = records
        self.requests = requests
        self.workers = workers
        self.tenant = tenant  # the namespace's own tenant, when a caller names none
        self.block_nbytes = slots.block_nbytes

    def prepare_save(self, keys: Sequence[bytes], tenant: bytes | None = None) -> SaveBatch:
        """Phase one: reserve host slots for the keys not stored yet (each key is one request
        of its block, for admission). A key held already is not stored again; one given no slot
        otherwise is counted by why: ``saves_no_room``, ``saves_in_flight`` (another save or
        load is storing it), ``saves_dropped_withdrawn`` (a withdrawn copy a load still reads)
        or ``saves_held_by_failed_load`` (a failed layer-wise load holds its slot until that
        load is released: nothing was withdrawn); the next save of those last two is stored."""
        tenant = self.tenant if tenant is None else tenant
        counts = self.requests.request(keys)
        slots = self.host.reserve_many(list(keys), tenant=tenant)
        if None not in slots:  # every key got a slot (the common case): nothing to sort out
            return SaveBatch(list(keys), slots, 0, tenant, counts)
        kept = [(k, s) for k, s in zip(keys, slots) if s is not None]
        skipped = len(keys) - len(kept)
        if skipped:  # held already (computed again), being stored by another save or load (or
            # twice in this one), a withdrawn copy a load still reads or a failed layer-wise
            # load's reservation (neither stored this time: counted), no room
            unreserved = [(k, n) for k, s, n in zip(keys, slots, counts) if s is None]
            states = self.host.states_many([k for k, _ in unreserved])
            for state, event in ((None, "saves_no_room"), ("reserved", "saves_in_flight"),
                                 ("retired", "saves_dropped_withdrawn"),
                                 ("failed", "saves_held_by_failed_load")):
                if n := states.count(state):
                    self.metrics.event(event, n)
            self.write_earned([kn for kn, state in zip(unreserved, states) if state == "ready"], tenant)
        by_key = dict(zip(keys, counts))
        return SaveBatch([k for k, _ in kept], [s for _, s in kept], skipped, tenant,
                         [by_key[k] for k, _ in kept])

    def commit_save(self, batch: SaveBatch, ok: bool = True) -> Future | None:
        """Phase two: publish the filled slots (or roll back) and queue write-behind."""
        if not batch.keys:
            return None
        if not ok:
            self.host.abort_many(batch.keys)
            self.metrics.event("saves_rolled_back", len(batch.keys))
            return None
        # leased as they become visible: a reservation elsewhere could evict one before the
        # write-behind leased it, and that block was then never written (a save lost unseen);
        # no tier written through (a host-only store): no lease, and none to give back
        self.host.commit_many(batch.keys, pin=bool(self.written_through))
        nbytes = len(batch.keys) * self.block_nbytes
        self.metrics.wrote("host", len(batch.keys), nbytes, nbytes, 0.0)
        if not self.written_through:
            return None
        return self.write_behind(batch.keys, batch.tenant, batch.counts, leased=dict(zip(batch.keys, batch.slots)))

    def save(self, keys: Sequence[bytes], payloads: Sequence[torch.Tensor],
             tenant: bytes | None = None, wait: float | None = None) -> Future | None:
        """Copy ``payloads`` (canonical block tensors) into the host tier and write behind.

        More blocks than the host tier holds at once are staged in chunks; a chunk waits for
        the write-behind of earlier ones when their leased slots are all the room there is, at
        most ``wait`` seconds over the call (None: as long as they take); what then finds no room
        is not staged (counted ``saves_no_room``). A hung tier below held such a call for as long
        as it hung (SGLang's backups: past its thread join). A block of another dtype, shape or
        kind is refused (BlockMismatch, counted ``saves_failed``), never converted; the chunk it
        is in is rolled back, and one of a call of several chunks is refused before any is."""
        if len(payloads) != len(keys):  # a block per key, or which block is whose is a guess
            raise ValueError(f"save of {len(keys)} keys with {len(payloads)} blocks")
        index: dict[bytes, int] | None = None  # made when a batch skipped some keys
        chunk = max(1, self.host.num_slots // 2)
        if len(keys) > chunk:  # (a single chunk is checked by its copy, then rolled back whole)
            try:
                self.slots.check_all(payloads)
            except BlockMismatch:
                self.metrics.event("saves_failed", len(keys))
                raise
        futures: list[Future] = []
        deadline = None if wait is None else time.monotonic() + wait
        for start in range(0, len(keys), chunk):
            part = list(keys[start : start + chunk])
            if futures and not self.host.can_reserve(len(part)):
                futures_wait(futures, None if deadline is None else max(0.0, deadline - time.monotonic()))
            batch = self.prepare_save(part, tenant)
            if batch.skipped:
                index = index or {k: i for i, k in enumerate(keys)}
                blocks = [payloads[index[k]] for k in batch.keys]
            else:
                blocks = payloads[start : start + chunk]
            try:
                self.slots.copy_blocks(batch.slots, blocks, into_slots=True)
            except Exception:
                self.commit_save(batch, ok=False)
                # (with the blocks of the chunks never staged: none of them was stored either)
                self.metrics.event("saves_failed", len(batch.keys) + len(keys) - start - len(part))
                raise
            fut = self.commit_save(batch)
            if fut is not None:
                futures.append(fut)
        return gather(futures)

    # -- write-behind ----------------------------------------------------------------------------
    def admitted(self, keys: Sequence[bytes], tiers: Sequence[EncodedTier], counts: Sequence[int] | None = None,
                 earned_only: bool = False) -> dict[tuple[EncodedTier, ...], list[bytes]]:
        """``keys`` grouped by the tiers of ``tiers`` that admit them: a tier whose
        ``admit_after_hits`` the key's request count (``counts``, else the table's) has reached.
        With ``earned_only`` (the block is requested again while held), only tiers that wait for
        several requests and that the key was not queued for yet; else misses are counted."""
        if not self.requests.active:  # every tier admits at once: nothing to count or remember
            return {tuple(tiers): list(keys)} if tiers and keys and not earned_only else {}
        counts = self.requests.counts(keys) if counts is None else counts
        groups: dict[tuple[EncodedTier, ...], list[bytes]] = {}
        skipped = 0
        for key, n in zip(keys, counts):
            want = [t for t in tiers if t.config.admit_after_hits <= max(n, 1)
                    and not (earned_only and t.config.admit_after_hits == 1)]
            if not earned_only:
                skipped += len(tiers) - len(want)
            names = self.requests.claim(key, [t.name for t in want], fresh_only=earned_only)
            want = [t for t in want if t.name in names]
            if want:
                groups.setdefault(tuple(want), []).append(key)
        if skipped:
            self.metrics.event("admission_skipped", skipped)
        return groups

    def write_earned(self, requested: Sequence[tuple[bytes, int]], tenant: bytes) -> None:
        """Host-resident blocks requested again ((key, request count) each): write them to the
        tiers this request earned them (none unless some tier admits after several requests)."""
        if not requested or not self.requests.active:
            return
        # leased first, so admission claims no tier for a key whose host copy is another tenant's
        # or gone (never written there, and its owner's next requests found that tier claimed)
        requested = list(dict(requested).items())  # (each key once: one lease each)
        slots = self.host.pin_many([k for k, _ in requested], bytes(tenant))
        held = [(k, n, s) for (k, n), s in zip(requested, slots) if s is not None]
        if held:
            self.write_behind([k for k, _, _ in held], tenant, [n for _, n, _ in held], earned_only=True,
                              leased={k: s for k, _, s in held})

    def write_behind(self, keys: list[bytes], tenant: bytes, counts: Sequence[int] | None = None,
                     earned_only: bool = False, leased: dict[bytes, int] | None = None) -> Future | None:
        """Queue the write of host-resident ``keys`` to the ``write_through`` tiers that admit them.
        ``leased``: the keys' slots, each already leased once for this write (released here
        when no tier takes the key, else when its write is done or dropped)."""
        targets = self.written_through
        groups = self.admitted(keys, targets, counts, earned_only) if targets else {}
        if leased is not None:
            taken = {k for group in groups.values() for k in group}
            self.host.unpin_many([k for k in keys if k not in taken])
        futures = []
        for tiers, group in groups.items():
            per_job = max(1, min(SAVE_CHUNK_BYTES // self.block_nbytes, -(-len(group) // self.workers)))
            for start in range(0, len(group), per_job):
                chunk = group[start : start + per_job]
                slots = [leased[k] for k in chunk] if leased is not None else self.host.pin_many(chunk, bytes(tenant))
                pinned = [(k, s) for k, s in zip(chunk, slots) if s is not None]
                if pinned:
                    fut = self._submit_write(pinned, list(tiers), tenant)
                    if fut is not None:
                        futures.append(fut)
        return gather(futures)

    def _submit_write(self, pinned: list[tuple[bytes, int]], targets: list[EncodedTier],
                      tenant: bytes) -> Future | None:
        """Queue the write of the host slots ``pinned`` to ``targets``; None when dropped."""
        keys = [k for k, _ in pinned]
        return self.submit_write(keys, lambda kept: self._write_job(pinned, targets, tenant),
                                 lambda kept: self._drop_write(keys, targets), replacement=True)

    def submit_write(self, keys: list[bytes], job, dropped, *, replacement: bool) -> Future | None:
        """Queue the write ``job(kept)`` of the ``kept`` of ``keys`` the withdrawals leave
        (:meth:`Invalidations.begin_write`), tracked as a write from before it is queued (so a
        withdrawal from then on deletes after it) and after any delete in flight of the same
        keys; ``dropped(kept)`` runs instead when the save budget refuses it (it may start the
        write another way and return its future: the write stays tracked until that is done).
        None when nothing is left to write or the budget refused it at once."""
        out: Future = WriteFuture()
        kept, deletes = self.invalidations.begin_write(keys, out, replacement=replacement)
        if not kept:
            out.set_result(0)
            return None

        def start() -> bool:
            queued = self.pool.try_submit_save(len(kept) * self.block_nbytes, lambda: job(kept))
            if queued is None:
                queued = dropped(kept)
                if queued is None:
                    out.set_result(0)
                    return False
            queued.add_done_callback(lambda j: settle(out, j))  # (never cancelled)
            return True

        if deletes:
            after(deletes, start)
            return out
        return out if start() else None

    def _drop_write(self, keys: list[bytes], targets: Sequence[EncodedTier]) -> None:
        self.host.unpin_many(keys)
        self._dropped(keys, targets)

    def _dropped(self, keys: list[bytes], targets: Sequence[EncodedTier]) -> None:
        """A write the save budget refused: counted, and its tiers' admission claims let go."""
        self.metrics.event("saves_dropped", len(keys))
        self.requests.release(keys, [t.name for t in targets])

    def _write_job(self, pinned: list[tuple[bytes, int]], targets: list[EncodedTier], tenant: bytes) -> int:
        """Write the leased slots ``pinned``, but those whose host copy was retired meanwhile
        (withdrawn: their bytes were taken before the withdrawal)."""
        try:
            live = [(k, s) for (k, s), state in zip(pinned, self.host.states_many([k for k, _ in pinned]))
                    if state not in (None, "retired", "failed")]
            return self.write_lower([(k, self.slots.row(s)) for k, s in live], targets, tenant)
        finally:
            self.host.unpin_many([k for k, _ in pinned])

    def write_lower(self, items: list[tuple[bytes, object]], targets: list[EncodedTier],
                    tenant: bytes) -> int:
        """Encode (once per codec setting) and store ``items`` in each target tier (keys the tier
        holds already are skipped), a chunk of about SAVE_CHUNK_BYTES at a time."""
        per_chunk = max(1, SAVE_CHUNK_BYTES // self.block_nbytes)
        return sum(self._write_chunk(items[start : start + per_chunk], targets, tenant)
                   for start in range(0, len(items), per_chunk))

    def _write_chunk(self, items: list[tuple[bytes, object]], targets: list[EncodedTier], tenant: bytes) -> int:
        """Blocks are encoded into this thread's arena (memory touched once and reused: a fresh
        object per block costs its page faults), which outlives every put of the chunk."""
        # codec settings encoded into the arena (a tier that gathers writes from the slot itself)
        settings = list(dict.fromkeys((t.codec.codec, t.codec.level) for t in targets if not t.gathers))
        room = _arena.views(len(items) * len(settings), max(t.stored_max for t in targets)) if settings else []
        position = {k: i for i, (k, _) in enumerate(items)}
        encoded: dict[tuple[str, int, bool], dict[bytes, object]] = {}
        stored = 0
        for tier in targets:
            have = tier.contains([k for k, _ in items])
            todo = [(k, p) for (k, p), held in zip(items, have) if not held]
            if not todo:
                continue
            self.records.keep(tier)
            start = time.perf_counter()
            setting = (tier.codec.codec, tier.codec.level, tier.gathers)
            base = None if tier.gathers else settings.index(setting[:2]) * len(items)
            cache = encoded.setdefault(setting, {})
            for k, p in todo:
                if k not in cache:
                    cache[k] = tier.encode(k, p, into=None if base is None else room[base + position[k]])
            ok = tier.put_blobs([(k, cache[k]) for k, _ in todo], len(todo) * self.block_nbytes, start, tenant)
            self.requests.release([k for (k, _), s in zip(todo, ok) if not s], [tier.name])  # (refused: may retry)
            stored += sum(ok)
        return stored

    def write_earned_copies(self, requested: Sequence[tuple[bytes, int, object]], tenant: bytes) -> None:
        """Blocks just loaded straight into a caller's memory ((key, request count, payload)
        each, not held by the host tier): queue copies for the tiers this request earned them.
        Called before the load's read ends as a tracked write, so a withdrawal of the keys either
        suppresses them here or deletes after these copies."""
        if not requested or not self.requests.active:
            return
        live = [r for r, gone in zip(requested, self.invalidations.suppressed([k for k, _, _ in requested]))
                if not gone]
        payloads = {k: p for k, _, p in live}
        targets = self.written_through
        for tiers, group in self.admitted([k for k, _, _ in live], targets, [n for _, n, _ in live],
                                          earned_only=True).items():
            self._queue_copies([(k, bytes(memoryview(payloads[k]).cast("B"))) for k in group], tiers, tenant)

    def on_host_evict(self, key: bytes, value: memoryview, tenant: bytes) -> None:
        """The host tier evicts ``key`` of ``tenant``: write it to the ``on_evict`` tiers that admit it."""
        targets = [t for t in self.tiers if t.policy == "on_evict"]
        for tiers, _ in self.admitted([key], targets).items():
            self._queue_copies([(key, bytes(value))], tiers, tenant)

    def _queue_copies(self, items: list[tuple[bytes, bytes]], tiers: Sequence[EncodedTier], tenant: bytes) -> None:
        """Queue the write of ``items`` (private copies of their payloads) to ``tiers``."""
        payloads = dict(items)
        self.submit_write([k for k, _ in items],
                          lambda kept: self.write_lower([(k, payloads[k]) for k in kept], list(tiers), tenant),
                          lambda kept: self._dropped(kept, tiers), replacement=False)
