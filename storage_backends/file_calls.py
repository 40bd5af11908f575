"""The event loop a file medium's calls run on, one thread per backend: the medium's sync
interface submits a coroutine and waits for it. A close refuses new calls, waits for the running
ones (at most a while: then they are cancelled, :class:`BackendClosed` to their callers) and
stops the loop; a call left waiting on a stopped loop used to wait for good."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from pathlib import Path

from tiered_kv.errors import BackendClosed

log = logging.getLogger(__name__)

CONCURRENCY = 16  # items (files read or written) at once per call


class LoopCalls:
    """Calls of the store at ``path`` on an event loop thread of their own."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.closed = False
        self._calls = threading.Condition()  # the calls running on the event loop (a close waits)
        self._running: set[concurrent.futures.Future] = set()
        self._loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._loop.run_forever, name="tiered-kv-file", daemon=True)
        self.thread.start()  # (the values' temporary names carry its id: the writes run on it)

    def run(self, coro):
        """``coro``'s result, run on the loop; BackendClosed once closed (or closed during it).
        What the coroutine raises is raised here."""
        with self._calls:
            if self.closed:
                coro.close()
                raise BackendClosed(f"file backend at {self.path} is closed")
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
            self._running.add(future)
        try:
            return future.result()
        except concurrent.futures.CancelledError:  # (a close that could wait no longer)
            raise BackendClosed(f"file backend at {self.path} closed during the call") from None
        finally:
            with self._calls:
                self._running.discard(future)
                self._calls.notify_all()

    @staticmethod
    async def each(items, fn) -> list:
        """``fn(item)`` of each item, CONCURRENCY at once, results in order; the first failure
        is raised once every call has ended."""
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(item):
            async with gate:
                return await fn(item)

        # every call ends before this returns, a failed one too: a caller may reuse the buffers
        # it handed in as soon as the batch is over (the store encodes into reused memory)
        results = await asyncio.gather(*(one(item) for item in items), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return list(results)

    def close(self, wait_s: float) -> None:
        """Refuse new calls, wait for running ones (at most ``wait_s``: then they are cancelled),
        stop the event loop. Idempotent."""
        with self._calls:
            if self.closed:
                return
            self.closed = True
            cancelled = list(self._running) if not self._calls.wait_for(lambda: not self._running,
                                                                         wait_s) else []
            for future in cancelled:
                future.cancel()
        if cancelled:  # their coroutines clean up (temporary files) before the loop stops
            log.warning("file store at %s: closed while %d calls still ran", self.path, len(cancelled))
            asyncio.run_coroutine_threadsafe(_others_ended(wait_s), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self.thread.join()
        self._loop.close()


async def _others_ended(timeout: float) -> None:
    """Wait (at most ``timeout``) for the event loop's other tasks to end."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if others:
        await asyncio.wait(others, timeout=timeout)
