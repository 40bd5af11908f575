"""Entries of the file medium on disk (layout in :mod:`storage_backends.file_layout`): publishing
a value under its key (for a tenant: its tenant file, then the key's link), removing one, listing
them (and temporary files killed writers left), and the check for files that do not belong.

These are plain blocking calls; the backend runs them on its event loop's threads. Several
processes may do them at once: each rename is atomic, so a reader sees the old value or the new
one; a race between two writers of one key can leave a tenant file no link points to, which
:func:`check_dir` reports (after STALE_S) and removes with ``fix``.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from pathlib import Path
from typing import NamedTuple

from storage_backends.file_layout import (
    MARKER,
    is_bucket,
    is_marker_temp,
    is_tenant_file,
    key_of,
    temp_of,
    tenant_file_of,
    tenant_of_link,
)
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


_MISSES = (errno.ENOENT, errno.ELOOP, errno.ENOTDIR)  # absent, a link (not ours), no bucket
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
    held = value_of(path)
    if held is None:
        return None
    flags = OPEN_FLAGS | os.O_NOFOLLOW
    untouched = 0 if touch else getattr(os, "O_NOATIME", 0)
    try:
        try:
            fd = os.open(held, flags | untouched)
        except PermissionError:
            if not untouched:
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
    with os.fdopen(fd, "rb") as fh:
        data = fh.read()
        if touch:
            try:
                os.utime(fd, ns=(time.time_ns(), st.st_mtime_ns))
            except OSError:  # (EPERM: another user's file; EROFS: a read-only mount)
                pass
    return data


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


def publish(tmp: Path, path: Path, tenant: bytes) -> None:
    """Make the value written to ``tmp`` the value of the key named ``path``, for ``tenant``;
    the file of a previous tenant of the key goes."""
    old = _our_link_of(path)
    target = target_of(path, tenant)
    os.replace(tmp, target)
    if tenant and old != target.name:
        link = temp_of(path, "link")
        os.symlink(target.name, link)
        try:
            os.replace(link, path)
        except BaseException:
            _unlink(link)
            raise
    if old is not None and old != (target.name if tenant else None):
        _unlink(path.parent / old)


def sync_dir(path: Path) -> None:
    """fsync the directory ``path`` (the names renamed in it are durable after it)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> int | None:
    """Remove the key named ``path`` (and its tenant's file); its size, or None when absent.
    A directory there is left alone; a link that is not ours goes, never what it points to."""
    st = value_stat(path)  # (None: absent, or a link whose file went)
    size = st.st_size if st is not None else None
    old = _our_link_of(path)
    try:
        if not _unlink(path):
            return None
    except IsADirectoryError:
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


def check_dir(root: Path, fix: bool = False) -> list[str]:
    """Files that do not belong under ``root``: leftover temporary files, tenant files no link
    points to (both when older than STALE_S), links to nothing, foreign files and directories;
    with ``fix``, the files in the buckets and the marker's leftover temporaries (never a
    directory, nor a foreign file beside the buckets: an operator's, another program's) are
    removed as they were judged: one replaced meanwhile (a put of the key since) stays."""
    problems = []
    now = time.time()
    for sub in os.scandir(root):
        if sub.is_dir(follow_symlinks=False) and is_bucket(sub.name):
            problems += _check_bucket(Path(sub.path), fix, now)
            continue
        try:
            problem = _top_problem(sub, now)
        except FileNotFoundError:  # gone since the scan
            continue
        if problem:
            problems.append(f"{problem}: {sub.name}")
            if fix and problem == "leftover temporary file":  # (the marker's: ours; a foreign file
                _drop(Path(sub.path), sub.inode())  # beside the buckets is not, and stays)
    return problems


def _top_problem(entry: os.DirEntry, now: float) -> str | None:
    if entry.name == MARKER:
        return None
    if entry.is_dir(follow_symlinks=False):
        return "foreign directory"  # not a bucket: never walked, never removed
    if is_marker_temp(entry.name):
        recent = now - entry.stat(follow_symlinks=False).st_mtime < STALE_S
        return None if recent else "leftover temporary file"
    return "foreign file"


def _check_bucket(bucket: Path, fix: bool, now: float) -> list[str]:
    try:
        entries = list(os.scandir(bucket))
    except FileNotFoundError:  # removed since the listing above: nothing of the store's
        return []
    linked = {link_of(Path(e.path)) for e in entries if e.is_symlink()}
    problems = []
    for entry in entries:
        try:
            problem = _problem(entry, bucket.name, linked, now)
        except FileNotFoundError:  # renamed or removed since the scan (a live store)
            continue
        if problem:
            problems.append(f"{problem}: {bucket.name}/{entry.name}")
            if fix and problem != "foreign directory":
                dangling = link_of(Path(entry.path)) if problem.startswith("link to") else None
                _drop(Path(entry.path), entry.inode(), dangling)
    return problems


def _problem(entry: os.DirEntry, bucket: str, linked: set, now: float) -> str | None:
    name = entry.name
    if entry.is_dir(follow_symlinks=False):
        return "foreign directory"
    if key_of(name) is not None and name.endswith(bucket):
        if not entry.is_symlink():
            return None
        try:
            target = os.readlink(entry.path)  # FileNotFoundError: gone since the scan
        except OSError:  # a plain value now (rewritten for no tenant since the scan)
            return None
        if tenant_of_link(target) is None:
            return "foreign link"
        if os.path.exists(entry.path) or link_of(Path(entry.path)) != target:
            return None  # resolves, or was replaced or removed since
        return "link to a missing tenant file"
    st = entry.stat(follow_symlinks=False)  # gone: the caller skips it
    if is_tenant_file(name):
        if entry.is_symlink():
            return "foreign link"  # a value is a file: read through no link of a link
        return None if name in linked or now - st.st_mtime < STALE_S else "tenant file no key links to"
    if name.endswith(".tmp"):  # maybe being written, or a tombstone: by ctime, as _left_behind
        return None if now - st.st_ctime < STALE_S else "leftover temporary file"
    return "foreign file"


def _drop(path: Path, inode: int, dangling: str | None = None) -> None:
    """Remove ``path`` if it is still the file judged (``inode``) and, for a link judged to lead
    nowhere, its tenant file ``dangling`` still is not there: it is renamed to a name of this
    call first, so a value published under ``path`` since is never the one removed."""
    tomb = temp_of(path, "check")
    try:
        os.rename(path, tomb)
    except FileNotFoundError:
        return
    same = os.lstat(tomb).st_ino == inode
    if same and (dangling is None or not (path.parent / dangling).exists()):
        os.unlink(tomb)
        return
    try:  # back, unless another was published there meanwhile (newer: it stays)
        os.link(tomb, path, follow_symlinks=False)
    except FileExistsError:
        pass
    finally:
        os.unlink(tomb)


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
