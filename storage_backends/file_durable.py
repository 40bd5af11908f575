"""Making the file medium's directories, names and small files durable: a bucket directory made
(a file under its name refuses the bucket's keys), an fsync of a directory (the names renamed or
linked in it survive a crash after it) and a small file written whole and fsync'd before it is
given its name (the store's marker: a crash right after a store was made used to leave an empty
marker, and the directory could no longer be opened)."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def make_bucket(path: Path) -> None:
    """The directory ``path`` (and those above it) made where missing. A file that is no
    directory under its name: NotADirectoryError (ENOTDIR), which refuses the values of the
    bucket's keys (:mod:`storage_backends.file_outcomes`; ``makedirs`` says EEXIST)."""
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        raise NotADirectoryError(errno.ENOTDIR, "a bucket of the store is no directory", str(path)) from None


def sync_dir(path: Path) -> None:
    """fsync the directory ``path`` (the names renamed in it are durable after it). A file system
    that cannot fsync a directory (EINVAL: some FUSE and SMB mounts) is taken as it is: its names
    are as durable as it makes them (a store on it could not be made, and a tenant's first put
    failed every time)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    """A new file ``path`` (never an existing one) holding ``data``, on the disk when this
    returns; removed again when it could not be written whole."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
