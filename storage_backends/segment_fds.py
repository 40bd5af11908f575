"""Open descriptors of segment files, shared by this process's threads: each use holds its
descriptor, so one is closed only once nobody reads or writes through it (a descriptor closed
under a reader could be reused by the next ``open``, and that reader would read another file).
At most ``max_idle`` descriptors are kept open while unused (the least recently used go first;
an ``open`` refused for lack of descriptors closes the idle ones and tries again, and for the
next ``RELAX_S`` seconds at most ``TIGHT_IDLE`` are kept), and those of
files another process deleted are closed once unused (checked at most once a second): a
deleted segment's disk space is freed only when its last descriptor closes.

A segment file whose deletion waits for the commit that drained it to be made durable is locked
exclusively meanwhile (:func:`lock_for_deletion`, from before that commit): a file no record
names that :func:`being_deleted` finds so locked is no orphan (a check reports none, a recovery
leaves it to the process deleting it)."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from storage_backends.segment_owners import lock_would_take
from storage_backends.segment_pruning import Pruning, forget_gone

log = logging.getLogger(__name__)

MAX_IDLE = 64
TIGHT_IDLE = 4  # the most kept idle once an open was refused for lack of descriptors ...
RELAX_S = 300.0  # ... until this long has passed without another refusal (a shortage can pass)


class Descriptors:
    """``path_of(segment)`` names each segment's file."""

    def __init__(self, path_of: Callable[[int], Path], max_idle: int = MAX_IDLE, extra_flags: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path_of = path_of
        self._wanted_idle = max_idle  # kept idle at most, but while a shortage lasts (max_idle)
        self._clock = clock
        self._refused_at: float | None = None  # when an open was last refused for lack of descriptors
        self.extra_flags = extra_flags  # added to every open (O_DIRECT for the direct writer's)
        self._lock = threading.Lock()
        self._fds: OrderedDict[int, tuple[int, bool]] = OrderedDict()  # segment -> (fd, writable), LRU order
        self._users: dict[int, int] = {}
        self._forgotten: dict[int, list[int]] = {}  # segment -> descriptors to close once unused
        self._pruning = Pruning()
        self._closed = False

    def create(self, segment: int) -> None:
        """Create ``segment``'s file (it must not exist) and keep it open for writing."""
        fd = self._open(segment, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        with self._lock:
            if not self._closed:
                self._fds[segment] = (fd, True)
                return
        os.close(fd)  # (closed meanwhile: kept, it would never be closed)
        raise OSError(errno.EBADF, "segment descriptors closed")

    @contextmanager
    def use(self, segment: int, write: bool = False):
        """``segment``'s descriptor (opened for writing with ``write``), held for the block
        (FileNotFoundError: no such file)."""
        fd = self.hold(segment, write)
        try:
            yield fd
        finally:
            self.release(segment)

    def deleted(self, segment: int) -> bool:
        """Whether ``segment``'s file, open here, was deleted (by anyone)."""
        with self._lock:  # held while looked at: closed meanwhile, its number could name another file
            entry = self._fds.get(segment)
            if entry is not None:
                self._users[segment] = self._users.get(segment, 0) + 1
        if entry is None:
            return not os.path.exists(self.path_of(segment))
        try:
            return os.fstat(entry[0]).st_nlink == 0
        except OSError:
            return True
        finally:
            self.release(segment)

    def hold(self, segment: int, write: bool = False) -> int:
        """:meth:`use` without the context manager (the read path's per-block cost): the
        descriptor, held until :meth:`release` of ``segment``."""
        if self._closed:
            raise OSError(errno.EBADF, "segment descriptors closed")
        self._maybe_prune()
        with self._lock:
            entry = self._fds.get(segment)
            if entry is not None and (entry[1] or not write):
                self._fds.move_to_end(segment)
                self._users[segment] = self._users.get(segment, 0) + 1
                return entry[0]
        fd = self._open(segment, os.O_RDWR if write else os.O_RDONLY)
        with self._lock:
            entry = self._fds.get(segment)
            if self._closed:  # closed meanwhile: kept, this one would never be closed
                os.close(fd)
                raise OSError(errno.EBADF, "segment descriptors closed")
            if entry is not None and (entry[1] or not write):  # another thread opened it meanwhile
                os.close(fd)
                fd = entry[0]
            else:
                if entry is not None:  # read-only, and a writer needs it: replace it
                    self._retire(segment, entry[0])
                self._fds[segment] = (fd, write)
            self._fds.move_to_end(segment)
            self._users[segment] = self._users.get(segment, 0) + 1
            return fd

    def _open(self, segment: int, flags: int) -> int:
        try:
            return os.open(self.path_of(segment), flags | self.extra_flags | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
        now = self._clock()  # (read before the lock: a clock is the caller's code)
        with self._lock:  # a process short of descriptors: keep few (a relax racing this sees it)
            fresh = self._refused_at is None
            self._refused_at = now
        if fresh and self._wanted_idle > TIGHT_IDLE:
            log.warning("out of file descriptors opening a segment: keeping at most %d idle for %.0f s "
                        "(raise the process's limit: ulimit -n)", TIGHT_IDLE, RELAX_S)
        self._close_idle(0)  # out of descriptors: let the idle ones go, and try once more
        return os.open(self.path_of(segment), flags | self.extra_flags | os.O_CLOEXEC, 0o644)

    def release(self, segment: int) -> None:
        with self._lock:
            self._users[segment] -= 1
            if self._users[segment]:
                return
            del self._users[segment]
            closing = self._forgotten.pop(segment, [])
        for fd in closing:
            os.close(fd)
        if len(self._fds) > self.max_idle:  # (unlocked look: at worst one sweep late)
            self._close_idle(self.max_idle)

    def _retire(self, segment: int, fd: int) -> None:
        """(under the lock) close ``fd`` now or once ``segment`` is unused."""
        if self._users.get(segment):
            self._forgotten.setdefault(segment, []).append(fd)
        else:
            os.close(fd)

    def _close_idle(self, keep: int) -> None:
        """Close the least recently used unused descriptors beyond ``keep``."""
        with self._lock:
            idle = [s for s in self._fds if not self._users.get(s)]
            for segment in idle[: max(0, len(idle) - keep)]:
                os.close(self._fds.pop(segment)[0])

    def forget(self, segment: int) -> None:
        """Close ``segment``'s descriptor now, or once its last user is done."""
        with self._lock:
            entry = self._fds.pop(segment, None)
            if entry is not None:
                self._retire(segment, entry[0])

    @property
    def max_idle(self) -> int:
        """Descriptors kept open while unused: few while a shortage lasts (until :meth:`_relax`)."""
        return self._wanted_idle if self._refused_at is None else min(self._wanted_idle, TIGHT_IDLE)

    @property
    def short(self) -> bool:
        """Whether an ``open`` was refused for lack of descriptors in the last ``RELAX_S``
        seconds: keep few idle, and hold none longer than a read needs."""
        refused = self._refused_at  # (read once: another thread may clear it)
        return refused is not None and self._clock() - refused < RELAX_S

    def _relax(self) -> None:
        """Once ``RELAX_S`` passed since the last refused ``open``, keep as many idle as asked
        again (unless an ``open`` was refused meanwhile)."""
        refused = self._refused_at  # (read once: another thread may clear it)
        if refused is None or self._clock() - refused < RELAX_S:
            return
        with self._lock:
            if self._refused_at != refused:  # refused again (or relaxed) meanwhile
                return
            self._refused_at = None
        if self._wanted_idle > TIGHT_IDLE:
            log.info("no segment open refused for lack of descriptors in %.0f s: keeping up to %d idle again",
                     RELAX_S, self._wanted_idle)

    def _maybe_prune(self) -> None:
        self._relax()
        if not self._pruning.due():
            return
        with self._lock:
            idle = [(s, fd) for s, (fd, _) in self._fds.items() if not self._users.get(s)]
        forget_gone(idle, lambda _, fd: os.fstat(fd).st_nlink == 0, self.forget)

    def close(self) -> None:
        """Close every descriptor (those in use once their users are done); no new uses."""
        with self._lock:
            self._closed = True
            segments = list(self._fds)
        for segment in segments:
            self.forget(segment)


def lock_for_deletion(path: Path) -> int | None:
    """An exclusive lock on ``path`` (its descriptor: closing it unlocks); None when it cannot be
    taken now (no such file, no descriptor left, someone else locks it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def being_deleted(path: Path) -> bool:
    """Whether a descriptor other than ours holds :func:`lock_for_deletion`'s lock on ``path``
    (False when that cannot be told: no such file, no descriptor left)."""
    return lock_would_take(path, fcntl.LOCK_SH) is False
