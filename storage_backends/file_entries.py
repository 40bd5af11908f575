"""Entries of the file medium on disk (layout in :mod:`storage_backends.file_layout`): publishing
a value under its key (for a tenant: its tenant file, then the key's link), removing one, listing
them (and temporary files killed writers left); :mod:`storage_backends.file_check` checks for
files that do not belong.

These are plain blocking calls; the backend runs them on its event loop's threads. Several
processes may do them at once: each rename is atomic, so a reader sees the old value or the new
one; a race between two writers of one key can leave a tenant file no link points to, which
:func:`~storage_backends.file_check.check_dir` reports (after STALE_S) and removes with ``fix``.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from pathlib import Path
from typing import NamedTuple

from storage_backends.file_layout import is_bucket, key_of, temp_of, tenant_file_of, tenant_of_link
from storage_backends.log_throttle import LogThrottle

log = logging.getLogger(__name__)

STALE_S = 600.0  # check(): temporary or unlinked tenant files older than this were left behind


class Stored(NamedTuple):
    key: bytes
    tenant: bytes
    stat: os.stat_result  # of the value (through the link for a tenant's)


def target_of(path: Path, tenant: bytes) -> Path:
    """Where a value of ``tenant`` for the key named ``path`` is written."""
    return tenant_file_of(path, tenant) if tenant else path


def value_of(path: Path) -> Path | None:
    """The file holding the value of the key named ``path``: ``path`` itself, or the tenant file
    its link names; None for a link that is not ours (one to /etc/passwd is never followed)."""
    target = link_of(path)
    if target is None:
        return path
    return path.parent / target if tenant_of_link(target) is not None else None


# absent, a link (not ours), no bucket; a socket (opening one is ENXIO: it failed the batch)
_MISSES = (errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.ENXIO)
# a value is opened without waiting: a named pipe under a key's name waited for a writer for good
# (O_NONBLOCK changes nothing for a regular file's reads)
OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_unreadable = LogThrottle(log)  # (read again at every lookup of its key: one warning a minute)


def read_value(path: Path, touch: bool) -> bytes | None:
    """The value of the key named ``path``; None when absent or when what is there is not a
    value of ours (a foreign link, a directory, a named pipe, a tenant file that is itself a
    link) or not one this process may read (another user's: one value's miss, never the batch's
    error). With ``touch``, its access time is set (best effort: another user's file, a
    read-only mount keep their own)."""
    opened = _open_value(path, untouched=not touch)
    if opened is None:
        return None
    fd, st = opened
    with os.fdopen(fd, "rb") as fh:
        data = fh.read()
        if touch:
            try:
                os.utime(fd, ns=(time.time_ns(), st.st_mtime_ns))
            except OSError:  # (EPERM: another user's file; EROFS: a read-only mount)
                pass
    return data


def holds_value(path: Path) -> bool:
    """Whether :func:`read_value` would find a value under the key named ``path``: the value is
    opened as a read opens it (so another user's unreadable file is no value, as its read is a
    miss), never read."""
    opened = _open_value(path, untouched=False)
    if opened is None:
        return False
    os.close(opened[0])
    return True


def _open_value(path: Path, untouched: bool) -> tuple[int, os.stat_result] | None:
    """A descriptor of the value of the key named ``path`` (a regular file of ours) and its
    stat; None where there is none, or none this process may open. ``untouched``: opened with
    O_NOATIME where this process may."""
    held = value_of(path)
    if held is None:
        return None
    flags = OPEN_FLAGS | os.O_NOFOLLOW
    noatime = getattr(os, "O_NOATIME", 0) if untouched else 0
    try:
        try:
            fd = os.open(held, flags | noatime)
        except PermissionError:
            if not noatime:
                raise
            fd = os.open(held, flags)  # (O_NOATIME needs the file's owner)
    except OSError as exc:
        if exc.errno == errno.EACCES:
            _unreadable.warning("file store: %s is not readable by this process (another user's "
                                "file?): a miss", held)
        if exc.errno in _MISSES or exc.errno == errno.EACCES:
            return None
        raise
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):  # (a directory)
        os.close(fd)
        return None
    return fd, st


def value_stat(path: Path) -> os.stat_result | None:
    """The stat of the value of the key named ``path``; None where :func:`read_value` finds
    none."""
    held = value_of(path)
    try:
        st = os.stat(held, follow_symlinks=False) if held is not None else None
    except OSError as exc:
        if exc.errno in _MISSES:
            return None
        raise
    return st if st is not None and stat.S_ISREG(st.st_mode) else None


def held_value(path: Path) -> tuple[int, bytes] | None:
    """(size, tenant) of the value of the key named ``path``; None: none (or none to be seen)."""
    try:
        st = value_stat(path)
        return None if st is None else (st.st_size, tenant_at(path) or b"")
    except OSError:
        return None


def publish(tmp: Path, path: Path, tenant: bytes) -> None:
    """Make the value written to ``tmp`` the value of the key named ``path``, for ``tenant``;
    the file of a previous tenant of the key goes. A tenant file whose link could not be made
    (a directory under the key's name, a full disk) goes again: no key would ever link to it."""
    old = _our_link_of(path)
    target = target_of(path, tenant)
    written = os.lstat(tmp).st_ino
    os.replace(tmp, target)
    if tenant and old != target.name:
        link = temp_of(path, "link")
        try:
            os.symlink(target.name, link)
            try:
                os.replace(link, path)
            except BaseException:
                _unlink(link)
                raise
        except BaseException:
            _unlink_if(target, written)
            raise
    if old is not None and old != (target.name if tenant else None):
        _unlink(path.parent / old)


def remove(path: Path) -> int | None:
    """Remove the key named ``path`` (and its tenant's file); its size, or None when absent.
    A directory there is left alone; a link that is not ours goes, never what it points to."""
    st = value_stat(path)  # (None: absent, or a link whose file went)
    size = st.st_size if st is not None else None
    old = _our_link_of(path)
    try:
        if not _unlink(path):
            return None
    except (IsADirectoryError, NotADirectoryError):  # (the latter: a file holds its bucket's name)
        return None
    if old is not None:
        _unlink(path.parent / old)
    return size


def _our_link_of(path: Path) -> str | None:
    """Where ``path`` links when it is a link of ours (to a tenant file next to it)."""
    target = link_of(path)
    return target if target is not None and tenant_of_link(target) is not None else None


def tenant_at(path: Path) -> bytes | None:
    """The tenant of the key named ``path`` (b"" for a plain value; None when absent)."""
    old = link_of(path)
    if old is not None:
        return tenant_of_link(old)
    return b"" if path.exists() else None


def stored_files(root: Path, leftovers: list[Path] | None = None) -> list[Stored]:
    """Every stored value under ``root`` with its tenant; temporary, unlinked and foreign files
    are skipped (the temporary files :func:`_left_behind` go into ``leftovers`` when given).
    OSError when the directory cannot be read."""
    out = []
    now = time.time()
    for sub in os.scandir(root):
        if not sub.is_dir(follow_symlinks=False) or not is_bucket(sub.name):
            continue
        for entry in os.scandir(sub.path):
            key = key_of(entry.name)
            if key is None or not entry.name.endswith(sub.name):
                if leftovers is not None and _left_behind(entry, now):
                    leftovers.append(Path(entry.path))
                continue
            tenant = tenant_of_link(link_of(Path(entry.path)) or "") if entry.is_symlink() else b""
            if tenant is None:
                continue  # a link that is not ours
            held = value_of(Path(entry.path)) if tenant else Path(entry.path)
            try:
                st = os.stat(held, follow_symlinks=False) if held is not None else None
            except FileNotFoundError:  # deleted meanwhile, or a link whose file went
                continue
            if st is not None and stat.S_ISREG(st.st_mode):  # (not a directory, not a link)
                out.append(Stored(key, tenant, st))
    return out


def _left_behind(entry: os.DirEntry, now: float) -> bool:
    """A temporary file unchanged for STALE_S: its writer stopped (killed) before the rename.
    Judged by its change time, which each write and the rename to a temporary name set: a
    tombstone of an old value (delete_if_unchanged's, check's) is live, whatever its mtime."""
    if not (entry.name.startswith(".") and entry.name.endswith(".tmp")):
        return False
    try:
        return now - entry.stat(follow_symlinks=False).st_ctime >= STALE_S
    except FileNotFoundError:  # renamed or removed since the scan
        return False


def drop_leftovers(found: list[Path]) -> int:
    """Remove the temporary files :func:`stored_files` found left behind (their bytes counted
    nowhere: each crash mid-put added its batch's); how many went. One this process may not
    remove (a store it only reads) stays for ``check``."""
    gone = 0
    for path in found:
        try:
            gone += _unlink(path)
        except OSError:
            pass
    if gone:
        log.info("file store at %s: removed %d temporary files writers left behind",
                 found[0].parent.parent, gone)
    return gone


def link_of(path: Path) -> str | None:
    """Where the link ``path`` points (None: no link, or nothing there)."""
    try:
        return os.readlink(path)
    except OSError:  # not there, or not a link
        return None


def _unlink(path: Path) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _unlink_if(path: Path, inode: int) -> None:
    """Remove ``path`` if it is still the file ``inode`` (best effort: on a failure's way out)."""
    try:
        if os.lstat(path).st_ino == inode:
            os.unlink(path)
    except OSError:
        pass


def put_back(tomb: Path, name: Path) -> None:
    """``tomb`` back under ``name`` unless something was published there meanwhile (newer). A
    link the file system refuses (ENOSPC on btrfs, EMLINK, EIO) renames the tombstone back
    instead (the value was unlinked, and lost); should that fail too, the tombstone stays, and
    the error is the call's."""
    try:
        os.link(tomb, name, follow_symlinks=False)
    except FileExistsError:
        pass
    except OSError:
        os.rename(tomb, name)  # (a value published in between is replaced: both hold the key's bytes)
        return
    os.unlink(tomb)


def owner_of(path: Path) -> int | None:
    """The user id owning ``path`` (a link: the link's), None when it cannot be told."""
    try:
        return os.lstat(path).st_uid
    except OSError:
        return None
