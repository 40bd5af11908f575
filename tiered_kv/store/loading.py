"""The load path of the tiered store: leases, loads in the transfer pool that validate, decode
and promote lower-tier blocks into host slots, and the release of what was leased.

Every host slot a load job reserves is committed or rolled back before the job ends, whatever
happens while reading (a reservation left behind would make every later load of that key wait
PROMOTION_WAIT_S for a commit that never comes), and a job never raises through its future: a
block it could not load is a miss with a reason in its plan."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field

import torch

from tiered_kv.errors import StoreClosed
from tiered_kv.store.direct_loads import LOAD_ERROR, DirectLoads
from tiered_kv.store.encoded_tier import EncodedTier
from tiered_kv.store.host_slots import HostSlots
from tiered_kv.store.invalidation import Invalidations
from tiered_kv.store.load_progress import LoadProgress
from tiered_kv.store.lower_reads import LowerReader
from tiered_kv.store.metrics import StoreMetrics
from tiered_kv.store.saving import Saver
from tiered_kv.store.transfer import TransferPool

PROMOTION_WAIT_S = 5.0  # how long a load waits for another load promoting the same block
CLOSED = "store_closed"  # miss reason of blocks whose load the closing store no longer started

log = logging.getLogger(__name__)


@dataclass
class LoadPlan:
    """Blocks promised to one load: where each comes from and the host slots leased so far."""

    keys: list[bytes]
    sources: list[str | None]  # "host" | "lower" per key at prepare time
    slots: list[int | None] = field(default_factory=list)  # leased host slot per key once ready
    reasons: list[str | None] = field(default_factory=list)  # miss reason per failed key
    served: list[str | None] = field(default_factory=list)  # tier that served each key
    futures: list[Future] = field(default_factory=list)
    lower_pinned: list[bytes] = field(default_factory=list)  # keys protected in the lower tiers
    counts: list[int] = field(default_factory=list)  # request count of each key (admission)
    tenant: bytes = b""  # whose blocks these are (copies into other tiers are theirs)
    released: bool = False
    progress: LoadProgress | None = None  # layer-wise loads: how far each block has arrived
    deferred: list[bytes] = field(default_factory=list)  # failed reservations kept until release
    started: float = 0.0  # perf_counter when the load started
    finished: float = 0.0  # perf_counter when its last job ended (0: no job)

    @property
    def read_seconds(self) -> float:
        """Wall time of the load's reads from the lower tiers (0 when all blocks were in host memory)."""
        return max(0.0, self.finished - self.started) if self.finished else 0.0

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self, timeout: float | None = None) -> LoadPlan:
        for f in self.futures:
            f.result(timeout)
        return self

    @property
    def ok(self) -> list[bool]:
        return [s is not None for s in self.slots]


class Loader:
    """Loading blocks: handed the host slots, the ordered lower tiers, what moves and counts, and
    the saver (blocks read from a lower tier are copied into the tiers above it that admit them)."""

    def __init__(self, slots: HostSlots, tiers: list[EncodedTier], pool: TransferPool,
                 metrics: StoreMetrics, invalidations: Invalidations, saver: Saver, reader: LowerReader,
                 workers: int) -> None:
        self.slots = slots
        self.host = slots.host
        self.tiers = tiers
        self.pool = pool
        self.metrics = metrics
        self.invalidations = invalidations
        self.saver = saver
        self.reader = reader  # reads lower tiers into slots or into callers' buffers
        self.workers = workers
        self.block_nbytes = slots.block_nbytes
        self._lock = threading.Lock()
        self._leases: dict[str, LoadPlan] = {}

    def prepare_load(self, keys: Sequence[bytes], tenant: bytes | None = None, *,
                     count: bool = True) -> LoadPlan:
        """Lease ``keys`` for a coming load: host entries are pinned now, lower-tier ones
        protected from eviction. Each key is one request of its block, for admission, unless
        ``count`` is False (a read that only checks what a later lease will load)."""
        keys = list(keys)
        tenant = self.saver.tenant if tenant is None else tenant
        slots = self.host.pin_many(keys, bytes(tenant))  # (another tenant's plaintext is not served)
        sources = ["host" if s is not None else "lower" for s in slots]
        plan = LoadPlan(keys, sources, slots=list(slots), reasons=[None] * len(keys),
                        served=["host" if s is not None else None for s in slots], tenant=tenant)
        plan.lower_pinned = [k for k, s in zip(keys, slots) if s is None]
        for tier in self.tiers:
            tier.pin(plan.lower_pinned)
        requests = self.saver.requests
        plan.counts = requests.request(keys) if count else requests.counts(keys)
        self.saver.write_earned([(k, n) for k, s, n in zip(keys, slots, plan.counts) if s is not None],
                                plan.tenant)
        return plan

    def lease(self, lease_id: str, keys: Sequence[bytes], tenant: bytes | None = None) -> LoadPlan:
        """``prepare_load`` kept under ``lease_id`` for a later :meth:`take_lease` (the scheduler
        half leases blocks when the engine allocates, the worker half loads them a step later)."""
        plan = self.prepare_load(keys, tenant)
        with self._lock:
            old = self._leases.pop(lease_id, None)
            self._leases[lease_id] = plan
        if old is not None:
            self.release(old)
        return plan

    def take_lease(self, lease_id: str, keys: Sequence[bytes], tenant: bytes | None = None) -> LoadPlan:
        """The plan leased under ``lease_id`` when it covers ``keys``, else a fresh one; its
        blocks belong to ``tenant`` (None: the namespace's)."""
        with self._lock:
            plan = self._leases.pop(lease_id, None)
        if plan is not None and plan.keys == list(keys):
            if tenant is not None:
                plan.tenant = tenant
            return plan
        if plan is not None:
            self.release(plan)
        return self.prepare_load(keys, tenant)

    def drop_lease(self, lease_id: str) -> None:
        with self._lock:
            plan = self._leases.pop(lease_id, None)
        if plan is not None:
            self.release(plan)

    def release_leases(self) -> None:
        """Release every plan still leased under an id (closing)."""
        with self._lock:
            leases, self._leases = list(self._leases.values()), {}
        for plan in leases:
            self.release(plan)

    def load(self, plan: LoadPlan, layered: bool = False) -> LoadPlan:
        """Start fetching the non-host blocks of ``plan`` into host slots (async). ``layered``:
        read layer group by layer group and report it in ``plan.progress`` (the caller copies
        each group out as it arrives); a failed block's slot stays reserved until release.
        StoreClosed when the store closed before any of its jobs was queued (nothing counted:
        the caller reports the whole load); once one was, the blocks left are ``store_closed``
        misses of the plan (raised then, the blocks the queued jobs read were counted twice:
        their hits, and the caller's misses of the whole load)."""
        plan.started = time.perf_counter()
        if layered:
            plan.progress = LoadProgress(len(plan.keys), self.block_nbytes)
            for i, slot in enumerate(plan.slots):
                if slot is not None:
                    plan.progress.hold(i, slot, self.block_nbytes)
        todo = [i for i, s in enumerate(plan.sources) if s != "host"]
        withdrawn = self.invalidations.suppressed([plan.keys[i] for i in todo]) if todo else []
        gone = [i for i, w in zip(todo, withdrawn) if w]  # lower-tier copies maybe wrong, being deleted
        self._start_jobs(plan, [i for i, w in zip(todo, withdrawn) if not w])  # (counts nothing before)
        host_hits = sum(1 for s in plan.sources if s == "host")
        if host_hits:
            self.metrics.hit("host", host_hits, host_hits * self.block_nbytes)
        if gone:
            self._missed(plan, gone, "invalidated")
        return plan

    def _missed(self, plan: LoadPlan, idx: list[int], reason: str) -> None:
        """Blocks ``idx`` of ``plan`` are not read: counted misses for ``reason``, their layer
        groups over (no forward waits for them)."""
        for i in idx:
            plan.reasons[i] = reason
        self.metrics.miss("host", reason, len(idx))
        if plan.progress is not None:
            plan.progress.end(idx)

    def _start_jobs(self, plan: LoadPlan, todo: list[int]) -> None:
        """Queue the load jobs of the blocks ``todo`` of ``plan`` (see :meth:`load`)."""
        if not todo:
            return
        per_job = -(-len(todo) // self.workers)
        for start in range(0, len(todo), per_job):
            idx = todo[start : start + per_job]
            try:
                future = self.pool.submit_load(len(idx) * self.block_nbytes, lambda idx=idx: self._load_job(plan, idx))
            except StoreClosed:
                if not plan.futures:
                    raise
                self._missed(plan, todo[start:], CLOSED)
                log.warning("%d blocks of a load not read: the store closed as it started (%s misses)",
                            len(todo) - start, CLOSED)
                return
            if plan.progress is not None:  # however the job ends (or never runs), its blocks are over
                future.add_done_callback(lambda _f, idx=idx, p=plan.progress: p.end(idx))
            plan.futures.append(future)

    def _load_job(self, plan: LoadPlan, idx: list[int]) -> None:
        keys = [plan.keys[i] for i in idx]
        slots = self.host.reserve_many(keys, tenant=plan.tenant)
        want = [(i, s) for i, s in zip(idx, slots) if s is not None]
        if plan.progress is not None:
            for i, slot in want:
                plan.progress.hold(i, slot)
        # keys this job could not reserve are leased once another load promoted them, after
        # this job committed its own (a job never waits while holding reservations)
        others = [i for i, slot in zip(idx, slots) if slot is None]
        reasons: dict[int, str | None] = {i: LOAD_ERROR for i, _ in want}  # until read
        reading: Future = Future()  # copies up are writes: a withdrawal deletes after them
        self.invalidations.track_write([plan.keys[i] for i, _ in want], reading)
        try:
            reasons = self._read_reserved(plan, want)
        except Exception:  # a bug, not a bad block (those are per-block reasons): never raised
            log.exception("load of %d blocks failed; they are counted as %s misses", len(want), LOAD_ERROR)
            self.metrics.miss("host", LOAD_ERROR, len(want))
        finally:
            reading.set_result(None)
            self._settle(plan, want, reasons)  # every reservation of this job ends here
            self.saver.write_earned([(plan.keys[i], plan.counts[i]) for i, _ in want if reasons[i] is None],
                                    plan.tenant)  # promoted: the tiers below may have been earned
            deadline = time.monotonic() + PROMOTION_WAIT_S  # one bound for the job, not per block
            shared = 0  # blocks another load promoted, leased here: host hits of this load
            for i in others:
                try:
                    pinned, why = self._pin_promoted(plan.keys[i], plan.tenant, deadline)
                except Exception:
                    log.exception("lease of a promoted block failed")
                    pinned, why = None, LOAD_ERROR
                plan.slots[i] = pinned
                plan.served[i] = "host" if pinned is not None else None
                if pinned is None:  # no room, or the other load failed: a counted miss
                    plan.reasons[i] = why
                    self.metrics.miss("host", why)
                else:
                    shared += 1
                    if plan.progress is not None:
                        plan.progress.hold(i, pinned, self.block_nbytes)
            if shared:
                self.metrics.hit("host", shared, shared * self.block_nbytes)
            plan.finished = max(plan.finished, time.perf_counter())

    def _read_reserved(self, plan: LoadPlan, want: list[tuple[int, int]]) -> dict[int, str | None]:
        """Read the blocks of ``want`` (plan index, reserved slot) from the lower tiers into
        their slots; the miss reason per plan index (None: loaded)."""
        idx = [i for i, _ in want]
        on_ready = None
        if plan.progress is not None:
            progress = plan.progress
            on_ready = lambda ready, end: progress.advance([idx[j] for j in ready], end)  # noqa: E731
        reasons, served = self.reader.read([plan.keys[i] for i in idx], [self.slots.row(s) for _, s in want],
                                           [plan.counts[i] for i in idx], plan.tenant, on_ready)
        for i, tier in zip(idx, served):
            if tier is not None:
                plan.served[i] = tier
        return dict(zip(idx, reasons))

    def _pin_promoted(self, key: bytes, tenant: bytes, deadline: float) -> tuple[int | None, str]:
        """Lease ``key`` in the host tier: (its slot, else why not). When another load is
        promoting it right now (two requests sharing a prefix load in the same step), wait for
        that load to commit or abort instead of failing the block (bounded by PROMOTION_WAIT_S);
        not for one that failed and keeps its reservation until its release (layer-wise: frames
        may still be copied out of it), which would hold this load, and the forward pass waiting
        on it, until the step ends. ``deadline`` (monotonic) bounds the wait of the whole job.
        Another tenant's block is not leased (``wrong_key``, as a lower tier's would be), nor a
        withdrawn copy (``invalidated``). Each turn decides on one read of the key's state: read
        twice, a commit in between made a promoted block a ``no_room`` miss."""
        delay, waited = 0.0002, False
        while True:
            (pinned,) = self.host.pin_many([key], bytes(tenant))
            if pinned is not None:
                return pinned, ""
            (state,) = self.host.states_many([key])
            if state == "ready":  # committed since, or another tenant's
                (pinned,) = self.host.pin_many([key], bytes(tenant))
                return (pinned, "") if pinned is not None else (None, "wrong_key")
            if state is None:  # aborted (the other load failed), or there was no room
                return None, "promotion_failed" if waited else "no_room"
            if state == "retired":  # withdrawn: its copy is left to the loads that leased it
                return None, "invalidated"
            if state == "failed":  # a failed load's reservation: never to be published
                return None, "promotion_failed"
            if time.monotonic() > deadline:  # ("reserved": being promoted, or saved, now)
                return None, "promotion_timeout"
            waited = True
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def release(self, plan: LoadPlan) -> None:
        """End the lease of every block of ``plan`` (after the caller copied them out)."""
        if plan.released:
            return
        plan.released = True
        try:
            for f in plan.futures:
                with contextlib.suppress(CancelledError):
                    f.exception()  # wait: a job may still write into its slots
        finally:
            self.host.unpin_many([k for k, s in zip(plan.keys, plan.slots) if s is not None])
            if plan.deferred:
                self.host.abort_many(plan.deferred)
            if plan.lower_pinned:
                for tier in self.tiers:
                    tier.unpin(plan.lower_pinned)

    def load_into(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Synchronous convenience: load ``keys`` and copy them into ``outs``; success per key
        (see :class:`~tiered_kv.store.direct_loads.DirectLoads`)."""
        return DirectLoads(self).load_into(keys, outs)

    def _settle(self, plan: LoadPlan, want: list[tuple[int, int]], reasons: dict[int, str | None]) -> None:
        """End the reservations of ``want``: loaded blocks are committed and leased to ``plan``,
        the others rolled back; the plan gets a slot or a reason per block."""
        good = [plan.keys[i] for i, _ in want if reasons[i] is None]
        bad = [plan.keys[i] for i, _ in want if reasons[i] is not None]
        try:
            self.host.commit_many(good, pin=True)
        finally:
            if plan.progress is None:
                self.host.abort_many(bad)
            else:  # the worker may still copy their checked frames out: freed at release, and
                self.host.retire_many(bad, withdrawn=False)  # marked failed now (no load waits on them)
                plan.deferred.extend(bad)
        for i, slot in want:
            plan.slots[i] = slot if reasons[i] is None else None
            plan.reasons[i] = reasons[i]
            if reasons[i] is not None:
                plan.served[i] = None
        failed = sum(reasons[i] not in (None, "invalidated") for i, _ in want)  # (a withdrawn one
        if failed:  # did not fail: it was not read, as on every other load path)
            self.metrics.event("loads_failed", failed)
