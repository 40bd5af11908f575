"""Read accesses of the LMDB tier recorded by a thread of the tier once many are buffered, never by
the reader that found them so.

Reads buffer their accesses (:mod:`storage_backends.lmdb_accesses`) and every write records them
in its transaction. In a run of reads with no write, they were recorded by the reader that took the
buffer over its bound: a write transaction on a loading thread, which waits for LMDB's one writer
(a write-behind commit, its fsync) and then updates five records a key (a load of 256 64 KiB blocks
took ~30 % longer for it, on 2 cores). A load now only wakes this thread."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from tiered_kv.errors import BackendError

log = logging.getLogger(__name__)


class AccessRecorder:
    """Handed ``apply`` (one write transaction that records every buffered access) and the tier's
    ``path`` (for its messages). :meth:`wake` asks its thread, started at the first wake, to run
    ``apply``; :meth:`close` ends the thread after the run in progress."""

    def __init__(self, apply: Callable[[], None], path: object) -> None:
        self.apply, self.path = apply, path
        self._lock = threading.Lock()
        self._wanted = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def wake(self) -> None:
        """Have the buffered accesses recorded soon, on the recorder's thread."""
        if self._wanted.is_set():  # (asked already: readers call this at every read past the bound)
            return
        with self._lock:
            if self._closed:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tiered-kv-lmdb-accesses", daemon=True)
                self._thread.start()
            self._wanted.set()

    def close(self) -> None:
        """No more runs; returns once a run in progress ended (the tier's close records the rest)."""
        with self._lock:
            self._closed, thread = True, self._thread
            self._wanted.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            if self._closed:
                return
            try:
                self.apply()
            except BackendError as exc:  # (the tier's guard logged a failed transaction; the
                log.debug("lmdb tier at %s: read accesses not recorded now: %s", self.path, exc)  # next write retries)
            except Exception:  # a bug: said, and the thread goes on (reads keep buffering)
                log.exception("lmdb tier at %s: recording read accesses failed", self.path)
