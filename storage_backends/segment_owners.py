"""Which process appends to a segment file, and whether it still runs: a segment's record names
its owner by pid, the pid's start time (pids are reused) and its pid namespace. An owner also
holds a shared ``flock`` on each segment file it appends to (:class:`Claims`; its record says so
with ``LOCKING`` in its namespace field): a process that dies drops its locks with its
descriptors, so a process of another pid namespace (the engine's next container, after a
crash), which cannot look the owner's pid up, can still tell that it is gone."""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import weakref
from pathlib import Path

LOCKING = 1 << 63  # in a record's owner_ns: its owner locks the segment's file while it appends


def process_start(pid: int) -> int | None:
    """``pid``'s start time in clock ticks after boot; None when no such process runs (a
    zombie, killed and not yet reaped, runs no more) or that cannot be told."""
    try:
        return _start_of(pid)
    except OSError:
        return None


def _start_of(pid: int) -> int | None:
    """:func:`process_start`; OSError when ``/proc`` cannot tell (no descriptor left, say)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    try:  # the command name may hold spaces and parentheses: fields follow the last ")"
        fields = stat[stat.rindex(b")") + 2 :].split()
        return None if fields[0] in (b"Z", b"X") else int(fields[19])
    except (ValueError, IndexError):
        return None


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 when unknown)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def owner_alive(record, path: Path | None = None) -> bool:
    """Whether the process appending to a segment (its ``SegmentRecord``; its file at ``path``)
    may still run. An owner of this pid namespace is looked up by its pid (taken to run when
    ``/proc`` cannot tell now, and while it holds the lock on the file: a ``/proc`` mounted with
    ``hidepid`` hides other users' processes); one of another pid namespace (another container
    on this host), which cannot be, is alive while it holds the lock on the file (an empty file
    tells nothing: its owner may be about to lock it), and taken to run where it takes no lock."""
    if record.owner_pid <= 0:
        return False
    if record.owner_ns & ~LOCKING == pid_namespace():  # its pid tells (a free lock may not: a
        try:  # lock emulated per process)
            if _start_of(record.owner_pid) == record.owner_start:
                return True
        except OSError:
            return True
        return bool(record.owner_ns & LOCKING) and path is not None and _lock_free(path) is False
    if record.owner_ns & LOCKING and path is not None:
        free = _lock_free(path)
        if free is not None:
            return not free
    return True


def _lock_free(path: Path) -> bool | None:
    """Whether nobody locks the file ``path``; None when that cannot be told (no such file, an
    empty one, a file system without locks)."""
    return lock_would_take(path, fcntl.LOCK_EX, empty_tells=False)


def lock_would_take(path: Path, operation: int, empty_tells: bool = True) -> bool | None:
    """Whether ``flock(operation)`` on the file ``path`` would be granted now (tried, and let go
    at once); None when that cannot be told (no such file, no descriptor left, a file system
    without locks; an empty file, unless ``empty_tells``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not empty_tells and os.fstat(fd).st_size == 0:
            return None
        fcntl.flock(fd, operation | fcntl.LOCK_NB)  # (released as the descriptor closes)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return None
    finally:
        os.close(fd)


class Claims:
    """The shared locks this process holds on the segment files it appends to, by segment: taken
    when it creates one (before its first write), dropped when it seals it (or closes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: dict[int, int] = {}
        self._closed = False
        forget_in_children(self)

    def forget_in_child(self) -> None:
        """In a process just forked from this one: close the copies of the locked descriptors
        (the locks stay the parent's). Kept, a child outliving its parent (a worker, a data loader)
        kept the dead parent's open segments looking written to: never sealed while it ran. The
        lock another thread may have held at the fork is not taken (it would never be let go)."""
        fds, self._fds, self._lock = list(self._fds.values()), {}, threading.Lock()
        close_copies(fds)

    def take(self, segment: int, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # (another process's check holds it for an instant)
            with self._lock:
                if self._closed:
                    raise OSError(errno.EBADF, "segment files closed")
                self._fds[segment] = fd
        except BaseException:
            os.close(fd)
            raise

    def drop(self, segments) -> None:
        with self._lock:
            fds = [self._fds.pop(s) for s in segments if s in self._fds]
        for fd in fds:
            os.close(fd)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)


_forgetting: weakref.WeakSet = weakref.WeakSet()  # holders of lock descriptors a fork's child must close


def forget_in_children(holder) -> None:
    """Have ``holder.forget_in_child()`` run in every child forked from this process from now on
    (it closes the child's copies of descriptors whose file locks say what this process does)."""
    _forgetting.add(holder)


def close_copies(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _after_fork_in_child() -> None:
    for holder in list(_forgetting):
        holder.forget_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
