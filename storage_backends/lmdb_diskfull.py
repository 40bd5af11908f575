"""A full disk as LMDB reports it. LMDB turns a short ``pwrite`` of a commit ("short write,
filesystem full?" in its source) into EIO, not ENOSPC: on a disk that fills under the
environment, most commits fail that way. Read as a plain I/O error it failed every put as an
error and every access-recording flush with BackendUnavailable, where a full disk is a refused
put (the room is made or the put refused, as for ENOSPC)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import lmdb

FULL_MARGIN = 8 << 20  # free bytes below which an EIO of a commit is read as the disk being full
_EIO = os.strerror(5)  # "Input/output error" (py-lmdb gives no errno, only its text)


def disk_is_full(path: Path) -> bool:
    """The file system holding ``path`` has (almost) no room left for this process."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < FULL_MARGIN


def commit(txn, path: Path) -> None:
    """``txn.commit()``; an EIO on a full disk is raised as ``lmdb.DiskError`` (a real I/O
    error on a disk with room stays what it was)."""
    try:
        txn.commit()
    except lmdb.Error as exc:
        if type(exc) is lmdb.Error and _EIO in str(exc) and disk_is_full(path):
            raise lmdb.DiskError(f"{exc} (the disk is full)") from exc
        raise


RESERVE_NAME = "reserve.space"
RESERVE_BYTES = 4 << 20  # room for a delete's copied pages (and the free list) on a full disk


class Reserve:
    """A file of room held beside the environment while the disk has it, given up when a delete
    finds the disk full: a commit copies every page it changes, so on a disk the store filled even
    a one-key delete had no room, and nothing could ever be deleted (nor written) again. Taken
    back by a later put that found room. Best effort: no room for it is no error."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / RESERVE_NAME
        self.held: bool | None = None  # None: not looked at yet
        self.unsupported = False

    def ensure(self) -> None:
        """Hold the reserve (after a put that found room); nothing when the disk has none."""
        if self.unsupported or (self.held and self.path.exists()):  # (another process may have given it up)
            return
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, RESERVE_BYTES)  # (real blocks: a sparse file frees nothing)
            finally:
                os.close(fd)
            self.held = True
        except OSError as exc:
            self.release()
            # (no fallocate here, a read-only directory: not tried again at every put)
            self.unsupported = exc.errno not in (errno.ENOSPC, errno.EDQUOT)

    def release(self) -> bool:
        """Give the room back to the disk; False when there was none to give."""
        had = self.held is not False and self.path.exists()
        try:
            os.unlink(self.path)
        except OSError:
            pass
        self.held = False
        return had
