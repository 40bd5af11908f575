"""When the kernel starts writing a segment's buffered values to the disk.

- ``later`` (the default): when the kernel decides (its dirty-page thresholds) or an fsync
  asks; on a host with much memory a flush then writes everything at once.
- ``background``: a thread of the tier asks the kernel to start writing each stretch of
  ``WRITEBACK_CHUNK_BYTES`` a segment received (``sync_file_range(SYNC_FILE_RANGE_WRITE)``),
  while the writers go on filling the page cache: the disk works during the writes, and a
  flush waits only for the last stretch. The writers never wait for it, but the kernel's
  writeback work then shares the cores with them: on this project's 2-vCPU VM no gain stood
  out of the noise and the page-cache write was lower in every paired run (README,
  *Writeback*), so it is not the default.
- ``eager``: each writer asks it for every value it wrote, before its write returns.

None of these makes a value durable; a flush (fsync) still does, and the kernel may write any
dirty page at any time anyway.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import queue
import threading
from collections.abc import Callable

from storage_backends.segment_fds import Descriptors
from tiered_kv.errors import ConfigError

log = logging.getLogger(__name__)

MODES = ("later", "background", "eager")
WRITEBACK_CHUNK_BYTES = 64 << 20  # background: a segment's writes are handed on in stretches of this
MAX_SPANS = 64  # segments with writes not handed on yet (older ones' rests are left to a flush)
SYNC_FILE_RANGE_WRITE = 2


def writeback_mode(mode: str | None, eager: bool = False) -> str:
    """The ``writeback`` option checked (``eager``, the older boolean spelling, asks for
    "eager"); "later" unless set."""
    if mode is None:
        return "eager" if eager else "later"
    mode = str(mode).strip().lower()
    if mode not in MODES:
        raise ConfigError(f"lmdb writeback must be one of {', '.join(MODES)}, got {mode!r}")
    if eager and mode != "eager":
        raise ConfigError(f"lmdb writeback={mode} contradicts eager_writeback=true")
    return mode


@functools.cache
def _sync_file_range():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing ``length`` bytes at ``offset`` of ``fd`` to the disk without waiting for
    it (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; nothing elsewhere), so a later
    fsync has little left to do."""
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, offset, length, SYNC_FILE_RANGE_WRITE)


class BackgroundWriteback:
    """Collects what writers wrote to each segment and hands every ``chunk_bytes`` of it to a
    thread of its own that starts its writeback."""

    def __init__(self, fds: Descriptors, chunk_bytes: int | None = None,
                 start: Callable[[int, int, int], None] | None = None) -> None:
        self.fds = fds
        self.chunk_bytes = WRITEBACK_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        self.start = start_writeback if start is None else start  # (fd, offset, length)
        self._lock = threading.Lock()
        self._spans: dict[int, tuple[int, int]] = {}  # segment -> (lowest, highest end) not handed on
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    def wrote(self, segment: int, offset: int, length: int) -> None:
        """A writer wrote ``length`` bytes at ``offset`` of ``segment``."""
        with self._lock:
            lo, hi = self._spans.get(segment, (offset, offset))
            lo, hi = min(lo, offset), max(hi, offset + length)
            if hi - lo < self.chunk_bytes:
                if segment not in self._spans and len(self._spans) >= MAX_SPANS:
                    del self._spans[next(iter(self._spans))]  # a segment left long ago
                self._spans[segment] = (lo, hi)
                return
            self._spans.pop(segment, None)
            if self._closed:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tiered-kv-writeback", daemon=True)
                self._thread.start()
        self._queue.put((segment, lo, hi - lo))

    def forget(self, segment: int) -> None:
        """``segment`` is being deleted: nothing of it to hand on."""
        with self._lock:
            self._spans.pop(segment, None)

    def close(self) -> None:
        with self._lock:
            self._closed, thread, self._spans = True, self._thread, {}
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            segment, offset, length = item
            try:
                with self.fds.use(segment, write=True) as fd:
                    self.start(fd, offset, length)
            except OSError as exc:  # gone meanwhile, or the disk refuses: a flush will say so
                log.debug("writeback of segment %016x not started: %s", segment, exc)
