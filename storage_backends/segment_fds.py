"""Open descriptors of segment files, shared by this process's threads: each use holds its
descriptor, so one is closed only once nobody reads or writes through it (a descriptor closed
under a reader could be reused by the next ``open``, and that reader would read another file).
Descriptors of files another process deleted are closed once unused (checked at most once a
second): a deleted segment's disk space is freed only when its last descriptor closes."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

PRUNE_EVERY_S = 1.0


class Descriptors:
    """``path_of(segment)`` names each segment's file."""

    def __init__(self, path_of: Callable[[int], Path]) -> None:
        self.path_of = path_of
        self._lock = threading.Lock()
        self._fds: dict[int, int] = {}
        self._users: dict[int, int] = {}
        self._forgotten: dict[int, int] = {}  # segment -> descriptor to close once unused
        self._pruned = time.monotonic()

    def create(self, segment: int) -> None:
        """Create ``segment``'s file (it must not exist) and keep it open for writing."""
        fd = os.open(self.path_of(segment), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        with self._lock:
            self._fds[segment] = fd

    @contextmanager
    def use(self, segment: int):
        """``segment``'s descriptor, held for the block (FileNotFoundError: no such file)."""
        fd = self._acquire(segment)
        try:
            yield fd
        finally:
            self._release(segment)

    def _acquire(self, segment: int) -> int:
        self._maybe_prune()
        with self._lock:
            fd = self._fds.get(segment)
            if fd is not None:
                self._users[segment] = self._users.get(segment, 0) + 1
                return fd
        fd = os.open(self.path_of(segment), os.O_RDONLY | os.O_CLOEXEC)
        with self._lock:
            if segment in self._fds:  # another thread opened it meanwhile
                os.close(fd)
                fd = self._fds[segment]
            else:
                self._fds[segment] = fd
            self._users[segment] = self._users.get(segment, 0) + 1
            return fd

    def _release(self, segment: int) -> None:
        with self._lock:
            self._users[segment] -= 1
            if self._users[segment]:
                return
            del self._users[segment]
            fd = self._forgotten.pop(segment, None)
        if fd is not None:
            os.close(fd)

    def forget(self, segment: int) -> None:
        """Close ``segment``'s descriptor now, or once its last user is done."""
        with self._lock:
            fd = self._fds.pop(segment, None)
            if fd is None:
                return
            if self._users.get(segment):
                self._forgotten[segment] = fd
                return
        os.close(fd)

    def _maybe_prune(self) -> None:
        now = time.monotonic()
        if now - self._pruned < PRUNE_EVERY_S:
            return
        self._pruned = now
        with self._lock:
            idle = [(s, fd) for s, fd in self._fds.items() if not self._users.get(s)]
        for segment, fd in idle:
            try:
                deleted = os.fstat(fd).st_nlink == 0
            except OSError:
                deleted = True
            if deleted:
                self.forget(segment)

    def close(self) -> None:
        with self._lock:
            fds = list(self._fds.values()) + list(self._forgotten.values())
            self._fds, self._forgotten, self._users = {}, {}, {}
        for fd in fds:
            os.close(fd)
