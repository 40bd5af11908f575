"""The check of a file medium's directory for files that do not belong (``check``, ``verify``):
leftover temporary files and tenant files no key links to (older than
:data:`~storage_backends.file_entries.STALE_S`), links to nothing, foreign files and
directories; with ``fix`` the store's own leftovers are removed, each as it was judged (renamed
to a name of the check first: a value published under its name since stays)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from storage_backends import file_entries
from storage_backends.file_entries import link_of
from storage_backends.file_layout import (
    MARKER,
    is_bucket,
    is_marker_temp,
    is_tenant_file,
    key_of,
    temp_of,
    tenant_of_link,
)


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
        recent = now - entry.stat(follow_symlinks=False).st_mtime < file_entries.STALE_S
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
        return None if name in linked or now - st.st_mtime < file_entries.STALE_S else "tenant file no key links to"
    if name.endswith(".tmp"):  # maybe being written, or a tombstone: by ctime, as _left_behind
        return None if now - st.st_ctime < file_entries.STALE_S else "leftover temporary file"
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
    file_entries.put_back(tomb, path)  # (unless another was published there meanwhile: newer, it stays)
