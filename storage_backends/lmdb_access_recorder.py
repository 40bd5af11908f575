"""Read accesses of the LMDB tier recorded by a thread of the tier once many are buffered, never by
the reader that found them so.

Reads buffer their accesses (:mod:`storage_backends.lmdb_accesses`) and every write records them
in its transaction. In a run of reads with no write, they were recorded by the reader that took the
buffer over its bound: a write transaction on a loading thread, which waits for LMDB's one writer
(a write-behind commit, its fsync) and then updates five records a key (a load of 256 64 KiB blocks
took ~30 % longer for it, on 2 cores). A load now only wakes this thread.

A run takes the buffer inside its write transaction, holding LMDB's writer (a write that begins
later sees what it recorded), and while it runs the accesses count as pending (:meth:`pending`):
a flush, ``lru_order`` or ``check`` right after the reads waits for its commit instead of reading
the tables without them (with the buffer taken before LMDB's writer was got, a put meanwhile
evicted the keys just read, and ``lru_order`` left them out). The thread holds its recorder only
during a run: a tier dropped unclosed is collected, and the thread ends (it kept the environment,
its descriptors and map, for good)."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable

from storage_backends.lmdb_accesses import AccessBuffer
from tiered_kv.errors import BackendError

log = logging.getLogger(__name__)


class AccessRecorder:
    """Handed the tier's ``accesses``, ``apply`` (one write transaction that records every buffered
    access) and its ``path`` (for its messages). :meth:`wake` asks its thread, started at the first
    wake, to run ``apply``; :meth:`close` ends the thread after the run in progress."""

    def __init__(self, accesses: AccessBuffer, apply: Callable[[], None], path: object) -> None:
        self.accesses, self.apply, self.path = accesses, apply, path
        self.busy = False  # a run is under way (set before it takes the buffer, cleared after its commit)
        self._lock = threading.Lock()
        self._wanted = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def pending(self) -> bool:
        """Whether accesses are still to be recorded: buffered, or taken by the run under way (in
        this order: a run sets ``busy`` before it takes them, and clears it once they are committed)."""
        return bool(len(self.accesses)) or self.busy

    def wake(self) -> None:
        """Have the buffered accesses recorded soon, on the recorder's thread."""
        if self._wanted.is_set():  # (asked already: readers call this at every read past the bound)
            return
        with self._lock:
            if self._closed:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=_run, args=(weakref.ref(self), self._wanted),
                                                name="tiered-kv-lmdb-accesses", daemon=True)
                weakref.finalize(self, self._wanted.set).atexit = False  # (collected unclosed: it ends)
                self._thread.start()
            self._wanted.set()

    def close(self) -> None:
        """No more runs; returns once a run in progress ended (the tier's close records the rest)."""
        with self._lock:
            self._closed, thread = True, self._thread
            self._wanted.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def run_once(self) -> None:
        """Record what is buffered (nothing buffered: no transaction)."""
        self.busy = True
        try:
            if len(self.accesses):
                self.apply()
        except BackendError as exc:  # (the tier's guard logged a failed transaction; the next write retries)
            log.debug("lmdb tier at %s: read accesses not recorded now: %s", self.path, exc)
        except Exception:  # a bug: said, and the thread goes on (reads keep buffering)
            log.exception("lmdb tier at %s: recording read accesses failed", self.path)
        finally:
            self.busy = False


def _run(recorder: weakref.ref, wanted: threading.Event) -> None:
    """The recorder's thread; it holds the recorder (and so the tier) only during a run."""
    while True:
        wanted.wait()
        wanted.clear()
        current = recorder()
        if current is None or current._closed:
            return
        current.run_once()
        del current
