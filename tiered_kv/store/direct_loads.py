"""Synchronous loads into callers' own blocks (``TieredStore.load_into``): host hits are copied
out of their slots; when every destination is a plain CPU block, lower-tier blocks are decoded
straight into it (no host slot taken: the destination is host memory already) by the pool's
workers, sharing the blocks piece by piece, or by the calling thread when the load is small or
the workers are busy; other destinations (a GPU) are staged through host slots."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from itertools import repeat

import torch

from tiered_kv.errors import BlockMismatch, StoreClosed, TieredKVError
from tiered_kv.store.host_slots import bytes_of_each
from tiered_kv.store.shared_pieces import SharedPieces

LOAD_ERROR = "load_error"  # miss reason of blocks whose load job failed in an unexpected way
# the least a thread takes of a direct load at once: a read call's fixed cost (~35 us: its
# transaction, lookups, bookkeeping) stays small beside the bytes it moves (2 MiB blocks: 2 a
# piece; 64 KiB ones: 64, which segment runs read with a few calls)
LEAST_PIECE_BYTES = 4 << 20
STAND_IN_AFTER = 0.005  # s: no pool job of a direct load started by then: the caller reads itself

log = logging.getLogger(__name__)


class DirectLoads:
    """Handed the :class:`~tiered_kv.store.loading.Loader` whose leases, pool and readers it uses."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def load_into(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Synchronous convenience: load ``keys`` and copy them into ``outs``; success per key.
        Host hits are copied out of their slots. When every destination is a plain CPU block,
        lower-tier blocks are decoded straight into it by the pool's workers or this thread
        (the destination is host memory already: staging it in a host slot would only add a
        copy, and the block stays warm in the page cache or wherever its tier keeps it); other
        destinations (a GPU) are staged through host slots. Runs in chunks of half the host
        tier."""
        if len(outs) != len(keys):  # a destination per key, or a True would name no bytes
            raise ValueError(f"load_into of {len(keys)} keys into {len(outs)} blocks")
        _check_destinations(keys, outs)
        if self.loader.pool.closed:
            raise StoreClosed("load_into after the store was closed")
        ok: list[bool] = []
        chunk = max(1, self.loader.host.num_slots // 2)
        for start in range(0, len(keys), chunk):
            plan = self.loader.prepare_load(keys[start : start + chunk])
            part = outs[start : start + chunk]
            try:
                ok.extend(self._load_chunk(plan, part))
            except Exception as exc:
                if self.loader.pool.closed and not isinstance(exc, TieredKVError):  # its slab went
                    raise StoreClosed("the store was closed during load_into") from exc
                raise
            finally:
                self.loader.release(plan)
        return ok

    def _load_chunk(self, plan, part: Sequence[torch.Tensor]) -> list[bool]:
        """One chunk of :meth:`load_into`: success per key of ``plan``."""
        lower = [i for i, s in enumerate(plan.slots) if s is None]
        # (made before any job starts: torch calls drop and retake the GIL, and made in a job
        # beside another job's reads they took 160-200 us, against 12 us here)
        dests = bytes_of_each([part[i] for i in lower], accept=self.loader.slots.plain)
        if dests is not None:
            return self._load_direct(plan, part, lower, dests)
        self.loader.load(plan).wait()
        found = [(s, o) for s, o in zip(plan.slots, part) if s is not None]
        self.loader.slots.copy_blocks([s for s, _ in found], [o for _, o in found], into_slots=False)
        return plan.ok

    def _load_direct(self, plan, outs: Sequence[torch.Tensor], todo: list[int], dests: list) -> list[bool]:
        """The blocks ``todo`` read from the lower tiers straight into ``dests`` (their plain CPU
        blocks' bytes), host hits copied out of their slots; success per key. A load of at most
        one piece (:data:`LEAST_PIECE_BYTES` of blocks, or one block; every load with one
        worker) is read by this thread (a pool job would only add two thread hand-offs); a
        larger one is shared piece by piece (:class:`~tiered_kv.store.shared_pieces.SharedPieces`)
        by up to ``workers`` pool jobs, and when none of them started within
        :data:`STAND_IN_AFTER` (every worker busy with write-behind: a slow disk, a Redis put
        waiting out its timeout) this thread reads the pieces left beside any that start later.
        Jobs that never started are cancelled, on success and on failure alike."""
        hits = [(s, o) for s, o in zip(plan.slots, outs) if s is not None]
        if hits:
            self.loader.metrics.hit("host", len(hits), len(hits) * self.loader.block_nbytes)
        loaded = [s is not None for s in plan.slots]
        jobs: list[Future] = []
        try:
            if todo:
                if self.loader.pool.closed:
                    raise StoreClosed("transfer pool is closed")
                self._read_lower(plan, todo, dests, loaded, jobs)
            self.loader.slots.copy_blocks([s for s, _ in hits], [o for _, o in hits], into_slots=False)
        except BaseException:
            for job in jobs:  # one not started never will; release() waits for the others
                job.cancel()
            raise
        for job in jobs:
            if not job.cancel():  # (cancelled: it never started, and never will)
                for i in job.result():
                    loaded[i] = True
        return loaded

    def _read_lower(self, plan, todo: list[int], dests: list, loaded: list[bool], jobs: list[Future]) -> None:
        """Read the blocks ``todo`` here when they make one piece, else start pool jobs that
        share them (appended to ``jobs`` and ``plan.futures``) and stand in for them when none
        started in time; marks what this thread loaded in ``loaded``."""
        least = max(1, LEAST_PIECE_BYTES // max(1, self.loader.block_nbytes))
        threads = max(1, min(self.loader.workers, -(-len(todo) // least)))
        pieces = SharedPieces(len(todo), threads, least)
        if threads > 1:
            began = threading.Event()

            def job() -> list[int]:
                began.set()
                return self._take(plan, todo, dests, pieces)

            share = -(-len(todo) // threads) * self.loader.block_nbytes
            for _ in range(threads):
                jobs.append(self.loader.pool.submit_load(share, job))
                plan.futures.append(jobs[-1])  # release() waits for them, whatever happens here
            if began.wait(STAND_IN_AFTER):
                return
        for i in self._take(plan, todo, dests, pieces):
            loaded[i] = True

    def _take(self, plan, todo: list[int], dests: list, pieces: SharedPieces) -> list[int]:
        """Read pieces of ``todo`` until none is left; the indices loaded."""
        loaded: list[int] = []
        while (piece := pieces.take()) is not None:
            loaded += self._direct_job(plan, todo[piece.start : piece.stop], dests[piece.start : piece.stop])
        return loaded

    def _direct_job(self, plan, idx: list[int], dests: list) -> list[int]:
        """Read the blocks ``idx`` of ``plan`` into ``dests`` (their destinations' bytes); the
        indices loaded. Tracked as a write for invalidation (its copies up are writes); never
        raises."""
        keys = [plan.keys[i] for i in idx]
        reading: Future = Future()
        self.loader.invalidations.track_write(keys, reading)
        try:
            try:
                reasons, served = self.loader.reader.read(keys, dests, [plan.counts[i] for i in idx], plan.tenant)
            except Exception:  # a bug, not a bad block (those are per-block reasons)
                log.exception("load of %d blocks failed; they are counted as %s misses", len(idx), LOAD_ERROR)
                self.loader.metrics.miss("host", LOAD_ERROR, len(idx))
                reasons, served = [LOAD_ERROR] * len(idx), [None] * len(idx)
            loaded = [i for i, r in zip(idx, reasons) if r is None]
            try:  # the tiers below may have been earned (queued while the read is a tracked write)
                self.loader.saver.write_earned_copies([(plan.keys[i], plan.counts[i], dest) for i, dest, r
                                                       in zip(idx, dests, reasons) if r is None], plan.tenant)
            except Exception:  # the blocks were loaded; only their copies below are lost
                log.exception("queueing copies of %d loaded blocks failed", len(loaded))
        finally:
            reading.set_result(None)
        for i, reason, tier in zip(idx, reasons, served):
            plan.reasons[i], plan.served[i] = reason, tier
        failed = sum(r not in (None, "invalidated") for r in reasons)
        if failed:
            self.loader.metrics.event("loads_failed", failed)
        return loaded


def _check_destinations(keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> None:
    """BlockMismatch for a destination that is no tensor (an array raised AttributeError deep in
    the copy), and for one buffer given for two different keys: both were reported loaded, and
    jobs writing both at once could leave a mix of two blocks in it. (Views that only interleave,
    such as one block's slice of each layer of a pool, are other elements: left alone.)"""
    if not all(map(isinstance, outs, repeat(torch.Tensor))):
        kinds = sorted({type(o).__name__ for o in outs if not isinstance(o, torch.Tensor)})
        raise BlockMismatch(f"load_into destinations must be torch tensors, got {', '.join(kinds)}")
    try:  # first one call a block (the full key below asks five: it was ~30 % of a host load
        ptrs = list(map(torch.Tensor.data_ptr, outs))  # of 64 KiB blocks): all apart, none shared
        apart = len(set(ptrs)) == len(ptrs)  # (meta and empty tensors all start at 0)
    except RuntimeError:  # a tensor with no storage (sparse)
        apart = False
    if apart:  # else every destination is asked in full below
        return
    first: dict[tuple, bytes] = {}
    for o, key in zip(outs, keys):
        if o.device.type == "meta" or o.layout != torch.strided or o.numel() == 0:
            continue  # (refused further on, as blocks of another kind)
        seen = first.setdefault((o.device, o.data_ptr(), tuple(o.shape), o.stride()), key)
        if seen != key:
            raise BlockMismatch("load_into was given one destination for two different keys")
