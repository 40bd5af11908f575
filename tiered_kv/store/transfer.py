"""The transfer pool: a few threads that run encode/decode and backend I/O.

zstd, LMDB, memcpy and redis-py (with hiredis) release the GIL, so ``workers`` threads give
real parallelism. Loads run before queued saves (a prompt waiting for its KV matters more than
write-behind). Saves have a byte budget: over it, new saves are refused and the caller counts a
drop. Loads have a byte budget too, but are never dropped and never make the submitter wait
(``start_load_kv`` runs on the forward pass): a load over the budget is queued, in order, and
started as earlier loads finish. A job cancelled before it started (``Future.cancel``) gives its
bytes back at once, wherever it waits, and never runs.

A load queued while every worker runs a save gets a thread of its own (a *stand-in*, at most
``workers`` of them at once), which runs queued loads and ends when none is left: a save stuck
on a hung tier (a stalled network disk, another process holding LMDB's writer lock) held every
worker, and an engine's load through the host slots waited behind it as long as it hung (the
forward pass with it, for a synchronous load). Saves stay on the workers.

``close(timeout)`` waits for the jobs queued at most ``timeout`` seconds: then those not started
fail (:class:`~tiered_kv.errors.StoreClosed`) and those still running are left to their threads
(daemons), so a job hung in a tier does not hang the close (an engine's shutdown). A worker the
system cannot start fails the pool's construction (:class:`~tiered_kv.errors.ThreadsUnavailable`),
the workers started before it stopped (they were left running).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tiered_kv.errors import StoreClosed, ThreadsUnavailable

log = logging.getLogger(__name__)

LOAD, SAVE = 0, 1


@dataclass(frozen=True)
class Unfinished:
    """What :meth:`TransferPool.close` left undone (all zero: every thread ended)."""

    failed: int = 0  # jobs not started by the timeout: failed with StoreClosed, never run
    failed_save_bytes: int = 0  # the bytes of the saves among them
    running: int = 0  # jobs still running on their threads (a tier that does not answer)
    running_save_bytes: int = 0  # the bytes of the saves among them


class TransferPool:
    def __init__(self, workers: int, max_save_bytes: int, max_load_bytes: int) -> None:
        self.max_bytes = {SAVE: max_save_bytes, LOAD: max_load_bytes}
        self.inflight = {SAVE: 0, LOAD: 0}
        self.jobs = 0  # queued or running
        self._cond = threading.Condition()
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._closed = False
        self._waiting_loads: deque[tuple[int, Callable[[], Any], Future]] = deque()  # over budget
        self._saving = 0  # workers running a save now
        self._queued_loads = 0  # loads in the queue (not yet taken by a thread)
        self._stand_ins: set[threading.Thread] = set()  # threads running loads beside workers all saving
        self._threads: list[threading.Thread] = []
        for i in range(workers):
            thread = threading.Thread(target=self._run, name=f"tiered-kv-{i}", daemon=True)
            try:
                thread.start()
            except RuntimeError as exc:  # ("can't start new thread"): stop those started
                self.close()
                raise ThreadsUnavailable(f"transfer pool: worker {i + 1} of {workers} could not be "
                                         f"started: {exc}") from exc
            self._threads.append(thread)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (nothing more is accepted)."""
        return self._closed

    def try_submit_save(self, nbytes: int, fn: Callable[[], Any]) -> Future | None:
        """Queue a save, or return None when the save budget is exhausted (caller counts a drop)."""
        with self._cond:
            if self._closed:
                return None
            if self.inflight[SAVE] > 0 and self.inflight[SAVE] + nbytes > self.max_bytes[SAVE]:
                return None
            self.inflight[SAVE] += nbytes
            return self._put(SAVE, nbytes, fn)

    def submit_save(self, nbytes: int, fn: Callable[[], Any]) -> Future:
        """Queue a save that must not be dropped (rare: a replacement of a wrong stored copy);
        it counts against the save budget but is never refused for it."""
        with self._cond:
            if self._closed:
                raise StoreClosed("transfer pool is closed")
            self.inflight[SAVE] += nbytes
            return self._put(SAVE, nbytes, fn)

    def submit_load(self, nbytes: int, fn: Callable[[], Any]) -> Future:
        """Queue a load and return at once (never drops, never waits): over the load budget it
        waits in line and starts when earlier loads have finished."""
        fut: Future = Future()
        with self._cond:
            if self._closed:
                raise StoreClosed("transfer pool is closed")
            self.jobs += 1
            fut.add_done_callback(lambda f: self._cancelled(LOAD, nbytes, f))  # (not done: not run now)
            if self._waiting_loads or not self._load_fits(nbytes):
                self._waiting_loads.append((nbytes, fn, fut))
            else:
                self.inflight[LOAD] += nbytes
                self._queue_load((LOAD, next(self._seq), fn, fut, nbytes))
            stand_in = self._stand_in_wanted()
        self._start(stand_in)
        return fut

    def _load_fits(self, nbytes: int) -> bool:
        """Whether a load of ``nbytes`` may start now (one load always may, however large)."""
        return self.inflight[LOAD] == 0 or self.inflight[LOAD] + nbytes <= self.max_bytes[LOAD]

    def _admit_waiting_loads(self) -> None:
        """Start waiting loads, in order, while they fit the budget (called holding _cond)."""
        while self._waiting_loads and self._load_fits(self._waiting_loads[0][0]):
            nbytes, fn, fut = self._waiting_loads.popleft()
            self.inflight[LOAD] += nbytes
            self._queue_load((LOAD, next(self._seq), fn, fut, nbytes))

    def _queue_load(self, job: tuple) -> None:
        """(holding _cond) queue a load."""
        self._queued_loads += 1
        self._queue.put(job)

    def _stand_in_wanted(self) -> threading.Thread | None:
        """(holding _cond) a stand-in to start (after releasing the lock) when loads are queued
        and every worker runs a save; every such moment asks (a load queued, a worker taking a
        save, a waiting load admitted), so none is left behind a hung save."""
        if not self._queued_loads or self._saving < len(self._threads) or self._closed:
            return None
        if len(self._stand_ins) >= len(self._threads):
            return None
        thread = threading.Thread(target=self._stand_in, name="tiered-kv-load", daemon=True)
        self._stand_ins.add(thread)
        return thread

    def _start(self, thread: threading.Thread | None) -> None:
        """Start a stand-in :meth:`_stand_in_wanted` counted. One the system cannot start
        ("can't start new thread") is uncounted again, so that the next moment that asks may
        start one (counted for good, no later load got a stand-in); its loads stay queued for
        the workers, and no error reaches the submitter (a load already queued, a worker's loop)."""
        if thread is None:
            return
        try:
            thread.start()
        except RuntimeError as exc:
            with self._cond:
                self._stand_ins.discard(thread)
            log.warning("a stand-in thread for queued loads could not be started: %s", exc)

    def _put(self, kind: int, nbytes: int, fn: Callable[[], Any]) -> Future:
        """Queue a job accepted while holding ``_cond``, in the same section as the check that
        the pool is open: :meth:`close` then either refused it or finds it queued ahead of the
        workers' stop signals. (Accepted in one section and queued after it, a job could land
        behind the stop signals of workers that had left: it never ran, its future never
        completed, and a save reported stored was neither written nor counted.)"""
        fut: Future = Future()
        self.jobs += 1
        fut.add_done_callback(lambda f: self._cancelled(kind, nbytes, f))  # (not done: not run now)
        self._queue.put((kind, next(self._seq), fn, fut, nbytes))
        return fut

    def _cancelled(self, kind: int, nbytes: int, fut: Future) -> None:
        """A job's future is done: when it was cancelled before it started, give its bytes and
        its place back now (a worker that dequeues it later skips it). A load still waiting for
        the budget leaves the line, and the loads behind it may start."""
        if not fut.cancelled():
            return
        with self._cond:
            for i, (_, _, waiting) in enumerate(self._waiting_loads):
                if waiting is fut:
                    del self._waiting_loads[i]
                    break
            else:
                self.inflight[kind] -= nbytes
            self.jobs -= 1
            if kind == LOAD:
                self._admit_waiting_loads()
            stand_in = self._stand_in_wanted()
            self._cond.notify_all()
        self._start(stand_in)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job[2] is None:
                return
            with self._cond:
                self._queued_loads -= job[0] == LOAD
                running = job[3].set_running_or_notify_cancel()
                self._saving += running and job[0] == SAVE
                stand_in = self._stand_in_wanted()  # (this save may be the one that hangs)
            self._start(stand_in)
            if running:  # (else cancelled before it started: _cancelled gave its bytes back)
                self._execute(job)

    def _stand_in(self) -> None:
        """Run queued loads until the next job is none (a save or a stop stays for the workers);
        the decision to end is taken with the lock that queueing a load holds."""
        while True:
            with self._cond:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    job = None
                if job is not None and job[0] != LOAD:
                    self._queue.put(job)  # (its place in line is its sequence number)
                    job = None
                if job is None:
                    self._stand_ins.discard(threading.current_thread())
                    return
                self._queued_loads -= 1
                running = job[3].set_running_or_notify_cancel()
            if running:
                self._execute(job)

    def _execute(self, job: tuple) -> None:
        """Run a started job (its future set running) and account for its end."""
        kind, _, fn, fut, nbytes = job
        try:
            fut.set_result(fn())
        except BaseException as exc:  # reported through the future
            log.debug("transfer job failed: %r", exc)
            fut.set_exception(exc)
        finally:
            with self._cond:
                self.inflight[kind] -= nbytes
                self.jobs -= 1
                self._saving -= kind == SAVE  # (only workers run saves)
                if kind == LOAD:
                    self._admit_waiting_loads()
                self._cond.notify_all()

    def queued_bytes(self) -> dict[str, int]:
        with self._cond:
            waiting = sum(n for n, _, _ in self._waiting_loads)
            return {"save": self.inflight[SAVE], "load": self.inflight[LOAD] + waiting}

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or running; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self.jobs == 0, timeout)

    def close(self, timeout: float | None = None) -> Unfinished:
        """Accept nothing more, let the threads run what is queued and end. ``timeout``: wait
        at most that many seconds; the jobs not started by then fail with StoreClosed, those
        running are left to their threads; what was left is returned."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._closed:
                return Unfinished(running=self.jobs, running_save_bytes=self.inflight[SAVE])
            self._closed = True
            # loads waiting for the budget never start: their callers see the pool closed. One
            # cancelled meanwhile stays in line until its own callback takes it out.
            stopped = [item for item in self._waiting_loads if item[2].set_running_or_notify_cancel()]
            self._waiting_loads = deque(item for item in self._waiting_loads if item[2].cancelled())
            self.jobs -= len(stopped)
        for _, _, fut in stopped:
            fut.set_exception(StoreClosed("transfer pool closed before the load started"))
        for _ in self._threads:
            self._queue.put((2, next(self._seq), None, None, 0))
        for t in self._threads:
            t.join(_left(end))
        failed: list[tuple] = []
        if any(t.is_alive() for t in self._threads):  # (only with a timeout)
            failed = self._take_queued()
        for job in failed:
            job[3].set_exception(StoreClosed("transfer pool closed before the job started"))
        with self._cond:
            stand_ins = list(self._stand_ins)  # (each ends at the stop signals, or the queue's end)
        for t in stand_ins:
            t.join(_left(end))
        with self._cond:
            return Unfinished(len(failed), sum(j[4] for j in failed if j[0] == SAVE),
                              self.jobs, self.inflight[SAVE])

    def _take_queued(self) -> list[tuple]:
        """Take the jobs still queued out of the queue (the stop signals stay), set running:
        the jobs to fail (a cancelled one gave its bytes back in its callback already)."""
        taken: list[tuple] = []
        with self._cond:
            stops = []
            while True:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job[2] is None:
                    stops.append(job)
                    continue
                kind, _, _, fut, nbytes = job
                self._queued_loads -= kind == LOAD
                if fut.set_running_or_notify_cancel():
                    self.inflight[kind] -= nbytes
                    self.jobs -= 1
                    taken.append(job)
            for stop in stops:
                self._queue.put(stop)
            self._cond.notify_all()
        return taken


def _left(end: float | None) -> float | None:
    """Seconds left until ``end`` (None: no end)."""
    return None if end is None else max(0.0, end - time.monotonic())
