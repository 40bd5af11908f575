"""TieredStore: the host tier plus optional disk and remote tiers, with async transfers.

Lifecycle of a block:

- **save**: ``prepare_save(keys)`` reserves host slots (phase one, invisible), the caller fills
  them (``slot_tensor``), ``commit_save`` makes them visible (phase two) or rolls them back, and
  queues write-behind to the lower tiers whose policy is ``write_through`` (``on_evict`` tiers
  get a block when the host tier evicts it). Saves over the in-flight budget are dropped from
  write-behind and counted (the host copy stays).
- **lookup(keys)**: the number of leading keys present in some tier; no side effects.
- **load**: ``prepare_load(keys)`` leases the blocks (host pins, disk pins), ``load(plan)``
  runs in the pool: host hits are ready at once, disk/remote hits are validated and decoded into
  freshly reserved host slots (promotion) and leased to the caller; ``release(plan)`` ends the
  lease. Failures are per block with a counted reason; nothing unvalidated is handed out.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from storage_backends.host import HostBackend
from storage_backends.registry import open_backend
from tiered_kv.codec import BlockCodec
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import BackendError, ConfigError
from tiered_kv.keys import Namespace
from tiered_kv.metrics import StoreMetrics
from tiered_kv.records import encode_namespace, namespace_key
from tiered_kv.tier import EncodedTier
from tiered_kv.transfer import TransferPool
from tiered_kv.units import format_size

log = logging.getLogger(__name__)

SAVE_CHUNK_BYTES = 16 << 20  # write-behind job size: enough blocks to amortise a txn
PROMOTION_WAIT_S = 5.0  # how long a load waits for another load promoting the same block
RECORD_CHECK_S = 60.0  # how often the write path re-checks a tier's namespace record


def block_shape(ns: Namespace) -> tuple[int, int, int, int, int]:
    """Canonical payload shape ``[num_layers, 2, block_size, num_kv_heads, head_dim]``."""
    return (ns.num_layers, 2, ns.block_size, ns.num_kv_heads, ns.head_dim)


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"torch has no dtype {name!r}")
    return dtype


@dataclass
class SaveBatch:
    """Phase one of a save: host slots reserved for ``keys`` (others were skipped)."""

    keys: list[bytes]
    slots: list[int]
    skipped: int = 0  # keys already stored in the host tier or without room


@dataclass
class LoadPlan:
    """Blocks promised to one load: where each comes from and the host slots leased so far."""

    keys: list[bytes]
    sources: list[str | None]  # "host" | "lower" per key at prepare time
    slots: list[int | None] = field(default_factory=list)  # leased host slot per key once ready
    reasons: list[str | None] = field(default_factory=list)  # miss reason per failed key
    served: list[str | None] = field(default_factory=list)  # tier that served each key
    futures: list[Future] = field(default_factory=list)
    disk_pinned: list[bytes] = field(default_factory=list)
    released: bool = False

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self, timeout: float | None = None) -> "LoadPlan":
        for f in self.futures:
            f.result(timeout)
        return self

    @property
    def ok(self) -> list[bool]:
        return [s is not None for s in self.slots]


class TieredStore:
    """All tiers of one namespace (one model shard) in one process."""

    def __init__(self, config: TieredKVConfig, namespace: Namespace) -> None:
        self.config = config
        self.namespace = namespace
        self.shape = block_shape(namespace)
        self.dtype = torch_dtype(namespace.dtype)
        self.block_nbytes = self.dtype.itemsize
        for d in self.shape:
            self.block_nbytes *= d
        if config.host.capacity < self.block_nbytes:
            raise ConfigError(f"host.capacity {format_size(config.host.capacity)} holds no block of "
                              f"{format_size(self.block_nbytes)}")
        self.metrics = StoreMetrics()
        self.pool = TransferPool(config.workers, config.max_inflight_save, config.max_inflight_load)
        on_evict = [t for t in ("disk", "remote")
                    if getattr(config, t).url and getattr(config, t).policy == "on_evict"]
        self.host = HostBackend(capacity=config.host.capacity, slot_bytes=self.block_nbytes,
                                pinned=config.host.pinned,
                                on_evict=self._on_host_evict if on_evict else None)
        self._slot_views: list[torch.Tensor | None] = [None] * self.host.num_slots
        self._slot_rows = self.host.slab.numpy()  # [slot, byte]: host copies without torch ops
        self.disk = self._open_tier("disk", config.disk.url, capacity=config.disk.capacity,
                                    sync=config.disk.sync)
        self.remote = self._open_tier("remote", config.remote.url, ttl=config.remote.ttl,
                                      timeout=config.remote.timeout, retries=config.remote.retries)
        self.lower = [t for t in (self.disk, self.remote) if t is not None]
        self._record_due: dict[str, float] = {}  # tier -> when to check its namespace record
        self._lock = threading.Lock()
        self._leases: dict[str, LoadPlan] = {}
        self._closed = False
        self._metrics_ports: list[int] = []  # Prometheus exporter ports serving this store
        if config.metrics_port is not None:
            _export_metrics(self, config.metrics_port)
        log.info("tiered store for %s: block %s %s = %s; tiers: host%s", namespace.model_id,
                 self.shape, namespace.dtype, format_size(self.block_nbytes),
                 "".join(f", {t.name} ({t.backend.url})" for t in self.lower))

    def _open_tier(self, name: str, url: str | None, **options) -> EncodedTier | None:
        if not url:
            return None
        section = getattr(self.config, name)
        backend = open_backend(url, **options)
        codec = BlockCodec(section.codec, section.level)
        return EncodedTier(name, backend, codec, self.namespace, self.shape, self.metrics, section.policy)

    # -- views ---------------------------------------------------------------------------------
    def slot_tensor(self, slot: int) -> torch.Tensor:
        """Host slot ``slot`` as a canonical block tensor (shares memory with the slab)."""
        view = self._slot_views[slot]
        if view is None:  # made once per slot: the three tensor ops cost ~13 us a block
            view = self._slot_views[slot] = (
                self.host.slot_view(slot, self.block_nbytes).view(self.dtype).view(self.shape))
        return view

    def _plain(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a whole contiguous CPU block of our dtype and shape: copied to and from
        host slots with one memcpy on the calling thread. torch's CPU ``copy_`` splits every block
        over its OpenMP pool, and when another thread holds a core (the transfer pool compressing,
        the engine, a neighbour process) each block waits for a scheduler tick: host copies ran at
        0.2-0.5 GB/s that way against ~6 GB/s for one memcpy (tools/bench_tiers.py, 2 cores)."""
        return (t.device.type == "cpu" and t.dtype == self.dtype and t.shape == self.shape
                and t.is_contiguous() and not t.requires_grad)

    # -- lookup ----------------------------------------------------------------------------------
    def locate(self, keys: Sequence[bytes]) -> list[str | None]:
        """The first tier holding each key (None: nowhere). No side effects."""
        where: list[str | None] = ["host" if p else None for p in self.host.contains_many(keys)]
        for tier in self.lower:
            todo = [i for i, w in enumerate(where) if w is None]
            if not todo:
                break
            for i, present in zip(todo, tier.contains([keys[i] for i in todo])):
                if present:
                    where[i] = tier.name
        return where

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` some tier holds. Side-effect free."""
        where = self.locate(keys)
        n = 0
        while n < len(where) and where[n] is not None:
            n += 1
        return n

    # -- save ------------------------------------------------------------------------------------
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
                for key, slot in zip(batch.keys, batch.slots):
                    src = payloads[index[key]]
                    if self._plain(src):
                        np.copyto(self._slot_rows[slot], _bytes_of(src))
                    else:
                        self.slot_tensor(slot).copy_(src)
            except Exception:
                self.commit_save(batch, ok=False)
                raise
            fut = self.commit_save(batch)
            if fut is not None:
                futures.append(fut)
        return _gather(futures)

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
            fut = self.pool.try_submit_save(len(pinned) * self.block_nbytes,
                                            lambda p=pinned: self._write_job(p, targets))
            if fut is None:
                self.host.unpin_many([k for k, _ in pinned])
                self.metrics.event("saves_dropped", len(pinned))
                continue
            futures.append(fut)
        return _gather(futures)

    def _write_job(self, pinned: list[tuple[bytes, int]], targets: list[EncodedTier]) -> int:
        try:
            items = [(k, self.host.slot_view(s, self.block_nbytes).numpy()) for k, s in pinned]
            return self._write_lower(items, targets)
        finally:
            self.host.unpin_many([k for k, _ in pinned])

    def _write_lower(self, items: list[tuple[bytes, object]], targets: list[EncodedTier]) -> int:
        """Encode (once per codec setting) and store ``items`` in each target tier."""
        stored = 0
        encoded: dict[tuple[str, int], dict[bytes, bytes]] = {}
        for tier in targets:
            todo = [(k, p) for (k, p), have in zip(items, tier.contains([k for k, _ in items]))
                    if not have]
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
        """Keep the namespace record (``tiered_kv.records``) next to the blocks of ``tier``, for
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

    # -- load ------------------------------------------------------------------------------------
    def prepare_load(self, keys: Sequence[bytes]) -> LoadPlan:
        """Lease ``keys`` for a coming load: host entries are pinned now, disk ones protected."""
        keys = list(keys)
        slots = self.host.pin_many(keys)
        sources = ["host" if s is not None else "lower" for s in slots]
        plan = LoadPlan(keys, sources, slots=list(slots), reasons=[None] * len(keys),
                        served=["host" if s is not None else None for s in slots])
        if self.disk is not None:
            plan.disk_pinned = [k for k, s in zip(keys, slots) if s is None]
            self.disk.pin(plan.disk_pinned)
        return plan

    def lease(self, lease_id: str, keys: Sequence[bytes]) -> LoadPlan:
        """``prepare_load`` kept under ``lease_id`` for a later :meth:`take_lease` (the scheduler
        half leases blocks when the engine allocates, the worker half loads them a step later)."""
        plan = self.prepare_load(keys)
        with self._lock:
            old = self._leases.pop(lease_id, None)
            self._leases[lease_id] = plan
        if old is not None:
            self.release(old)
        return plan

    def take_lease(self, lease_id: str, keys: Sequence[bytes]) -> LoadPlan:
        """The plan leased under ``lease_id`` when it covers ``keys``, else a fresh one."""
        with self._lock:
            plan = self._leases.pop(lease_id, None)
        if plan is not None and plan.keys == list(keys):
            return plan
        if plan is not None:
            self.release(plan)
        return self.prepare_load(keys)

    def drop_lease(self, lease_id: str) -> None:
        with self._lock:
            plan = self._leases.pop(lease_id, None)
        if plan is not None:
            self.release(plan)

    def load(self, plan: LoadPlan) -> LoadPlan:
        """Start fetching the non-host blocks of ``plan`` into host slots (async)."""
        host_hits = sum(1 for s in plan.sources if s == "host")
        if host_hits:
            self.metrics.hit("host", host_hits, host_hits * self.block_nbytes)
        todo = [i for i, s in enumerate(plan.sources) if s != "host"]
        if not todo:
            return plan
        per_job = -(-len(todo) // self.config.workers)
        for start in range(0, len(todo), per_job):
            idx = todo[start : start + per_job]
            plan.futures.append(self.pool.submit_load(len(idx) * self.block_nbytes,
                                                      lambda idx=idx: self._load_job(plan, idx)))
        return plan

    def _load_job(self, plan: LoadPlan, idx: list[int]) -> None:
        keys = [plan.keys[i] for i in idx]
        slots = self.host.reserve_many(keys)
        # keys this job could not reserve are leased once another load promoted them, after
        # this job committed its own (a job never waits while holding reservations)
        others = [i for i, slot in zip(idx, slots) if slot is None]
        try:
            self._read_reserved(plan, [(i, s) for i, s in zip(idx, slots) if s is not None])
        finally:
            for i in others:
                pinned = self._pin_promoted(plan.keys[i])
                plan.slots[i] = pinned
                plan.served[i] = "host" if pinned is not None else None
                if pinned is None:  # no room is a counted miss
                    plan.reasons[i] = "no_room"
                    self.metrics.miss("host", "no_room")

    def _read_reserved(self, plan: LoadPlan, want: list[tuple[int, int]]) -> None:
        """Read the blocks of ``want`` (plan index, reserved slot) from the lower tiers."""
        reasons: dict[int, str | None] = {i: "absent" for i, _ in want}
        for tier in self.lower:
            pending = [(i, s) for i, s in want if reasons[i] is not None]
            if not pending:
                break
            outs = [self.host.slot_view(s, self.block_nbytes).numpy() for _, s in pending]
            copy_down = tier is self.remote and self.disk is not None and self.disk.policy != "off"
            got, blobs = tier.read_into([plan.keys[i] for i, _ in pending], outs, keep_blobs=copy_down)
            down = []
            for (i, _), reason, blob in zip(pending, got, blobs):
                if reason is None:
                    plan.served[i] = tier.name
                if reason is None or reasons[i] == "absent":
                    reasons[i] = reason  # keep the first real failure reason for the report
                if blob is not None:
                    down.append((plan.keys[i], blob))
            if down:
                self._record_namespace(self.disk)  # type: ignore[arg-type]
                self.disk.put_blobs(down, len(down) * self.block_nbytes)  # type: ignore[union-attr]
        good = [plan.keys[i] for i, _ in want if reasons[i] is None]
        bad = [plan.keys[i] for i, _ in want if reasons[i] is not None]
        self.host.commit_many(good, pin=True)
        self.host.abort_many(bad)
        for i, slot in want:
            plan.slots[i] = slot if reasons[i] is None else None
            plan.reasons[i] = reasons[i]
        if bad:
            self.metrics.event("loads_failed", len(bad))

    def _pin_promoted(self, key: bytes) -> int | None:
        """Lease ``key`` in the host tier. When another load is promoting it right now (two
        requests sharing a prefix load in the same step), wait for that load to commit or abort
        instead of failing the block (bounded by PROMOTION_WAIT_S)."""
        deadline = time.monotonic() + PROMOTION_WAIT_S
        delay = 0.0002
        while True:
            (pinned,) = self.host.pin_many([key])
            if pinned is not None or not self.host.reserved(key) or time.monotonic() > deadline:
                return pinned
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def release(self, plan: LoadPlan) -> None:
        """End the lease of every block of ``plan`` (after the caller copied them out)."""
        if plan.released:
            return
        plan.released = True
        for f in plan.futures:
            f.exception()  # wait: a job may still write into its slots
        self.host.unpin_many([k for k, s in zip(plan.keys, plan.slots) if s is not None])
        if self.disk is not None and plan.disk_pinned:
            self.disk.unpin(plan.disk_pinned)

    def load_into(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Synchronous convenience: load ``keys`` and copy them into ``outs``; success per key.
        Runs in chunks of half the host tier, so any number of blocks can be loaded."""
        ok: list[bool] = []
        chunk = max(1, self.host.num_slots // 2)
        for start in range(0, len(keys), chunk):
            plan = self.load(self.prepare_load(keys[start : start + chunk])).wait()
            try:
                for slot, out in zip(plan.slots, outs[start : start + chunk]):
                    if slot is None:
                        continue
                    if self._plain(out):
                        np.copyto(_bytes_of(out), self._slot_rows[slot])
                    else:
                        out.copy_(self.slot_tensor(slot))
                ok.extend(plan.ok)
            finally:
                self.release(plan)
        return ok

    # -- lifecycle ---------------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued write-behind and make the disk tier durable."""
        done = self.pool.drain(timeout)
        if self.disk is not None:
            self.disk.backend.flush()
        return done

    def stats(self) -> dict:
        snap = self.metrics.snapshot()
        snap["backends"] = {"host": self.host.stats().as_dict()}
        for tier in self.lower:
            try:
                snap["backends"][tier.name] = tier.backend.stats().as_dict()
            except Exception as exc:  # a down remote must not break stats
                snap["backends"][tier.name] = {"error": str(exc)}
        snap["queued_bytes"] = self.pool.queued_bytes()
        return snap

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with self._lock:
            leases, self._leases = list(self._leases.values()), {}
        for plan in leases:
            self.release(plan)
        try:
            self.flush()
        finally:
            if self._metrics_ports:
                from tiered_kv.exporter import unexport

                unexport(self)
            self.pool.close()
            for tier in self.lower:
                tier.backend.close()
            self.host.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _export_metrics(store: TieredStore, port: int) -> None:
    try:
        from tiered_kv.exporter import export
    except ImportError as exc:
        raise ConfigError(f"metrics_port needs prometheus-client (pip install 'tiered-kv[metrics]'): {exc}") from None
    export(store, port)


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a flat uint8 array (shares memory)."""
    return t.view(torch.uint8).numpy().reshape(-1)


def _gather(futures: list[Future]) -> Future | None:
    """One future that completes when all ``futures`` did (result: sum of their results)."""
    if not futures:
        return None
    if len(futures) == 1:
        return futures[0]
    out: Future = Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_f: Future) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            errors = [f.exception() for f in futures if f.exception() is not None]
            if errors:
                out.set_exception(errors[0])
            else:
                out.set_result(sum(f.result() or 0 for f in futures))

    for f in futures:
        f.add_done_callback(one_done)
    return out
