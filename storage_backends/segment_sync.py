"""The fsyncs of the LMDB tier's segment files (:mod:`storage_backends.lmdb_segments`), and the
segments whose fsync failed.

Linux reports a failed writeback to ``fsync`` once per open file: the pages whose write failed
are then marked clean, and the next ``fdatasync`` of the same file returns 0 although their data
never reached the disk. So a segment whose fsync failed is *poisoned* for this process: it is
never fsync'd again, no lane appends to it any more (``retire``), and every later sync that must
cover it raises, so no put writing to it is acknowledged as durable. The entries already
recorded in it are withdrawn by the tier (:meth:`storage_backends.lmdb_values.SegmentValues.withdraw`);
a segment is forgotten once its file is deleted."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from storage_backends.segment_fds import Descriptors


class SegmentSync:
    """What this process wrote to its segments since their last fsync, and its poisoned
    segments. ``retire(segments)`` stops every lane appending to ``segments``."""

    def __init__(self, directory: Path, fds: Descriptors, retire: Callable[[set[int]], None]) -> None:
        self.dir, self.fds, self._retire = directory, fds, retire
        self._lock = threading.Lock()  # the sets below
        self._syncing = threading.Lock()  # a sync returns only once every earlier write is durable
        self._dirty: set[int] = set()
        self._poisoned: set[int] = set()
        self._named = False  # the segments directory's own entry in the store's was fsync'd

    def wrote(self, segment: int) -> None:
        with self._lock:
            self._dirty.add(segment)

    def forget(self, segment: int) -> None:
        """``segment``'s file is being deleted."""
        with self._lock:
            self._dirty.discard(segment)
            self._poisoned.discard(segment)

    def poisoned(self) -> list[int]:
        """The segments whose fsync failed (that still exist)."""
        with self._lock:
            return sorted(self._poisoned)

    def sync(self, segments: Iterable[int] | None = None) -> None:
        """fsync every segment written to since the last sync (a poisoned one never again);
        returns once every write before the call is durable (a sync running in another thread
        included). OSError when one of ``segments`` is poisoned, by this call or an earlier one,
        or could not be opened to fsync it (left dirty, not poisoned); None: when an fsync of this
        call failed or a segment could not be opened."""
        with self._syncing:
            with self._lock:
                dirty, self._dirty = self._dirty - self._poisoned, set()
            failed: dict[int, OSError] = {}  # the fsync failed: poisoned
            unsynced: dict[int, OSError] = {}  # no descriptor to fsync it with (EMFILE): still dirty
            for segment in sorted(dirty):
                try:
                    with self.fds.use(segment) as fd:
                        try:
                            os.fdatasync(fd)
                        except OSError as exc:
                            failed[segment] = exc
                except FileNotFoundError:
                    continue  # deleted meanwhile
                except OSError as exc:  # (no fsync ran: nothing says a byte of it was lost)
                    unsynced[segment] = exc
            if failed:
                self._retire(set(failed))  # (first: nothing more is appended to them)
            with self._lock:
                self._poisoned |= failed.keys()
                self._dirty |= unsynced.keys()  # (the next sync tries again)
            if dirty:
                _sync_dir(self.dir)
                if not self._named:  # (made by the first segment: its files' names need its own, once)
                    self._named = _sync_dir(self.dir.parent)
            with self._lock:
                errors = {**failed, **unsynced}
                bad = sorted(errors) if segments is None else sorted(set(segments) & (self._poisoned | unsynced.keys()))
        if bad:
            exc = errors.get(bad[0])
            reason = exc.strerror if exc is not None else "an earlier fsync of it failed"
            raise OSError(exc.errno if exc is not None else errno.EIO,
                          f"fsync of segment {bad[0]:016x}: {reason}")


def _sync_dir(path: Path) -> bool:
    """fsync a directory (new segment files' names); whether it was."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        os.fsync(fd)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True
