"""Entries of the file medium on disk (layout in :mod:`storage_backends.file_layout`): publishing
a written value under its key (for a tenant: its tenant file, then the key's link), removing one,
listing them with their tenants, and the check for files that do not belong.

These are plain blocking calls; the backend runs them on its event loop's threads. Several
processes may do them at once: each rename is atomic, so a reader sees the old value or the new
one; a race between two writers of one key can leave a tenant file no link points to, which
:func:`check_dir` reports (after STALE_S) and removes with ``fix``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import NamedTuple

from storage_backends.file_layout import (
    MARKER,
    is_tenant_file,
    key_of,
    temp_of,
    tenant_file_of,
    tenant_of_link,
)

STALE_S = 600.0  # check(): temporary or unlinked tenant files older than this were left behind


class Stored(NamedTuple):
    key: bytes
    tenant: bytes
    stat: os.stat_result  # of the value (through the link for a tenant's)


def target_of(path: Path, tenant: bytes) -> Path:
    """Where a value of ``tenant`` for the key named ``path`` is written."""
    return tenant_file_of(path, tenant) if tenant else path


def publish(tmp: Path, path: Path, tenant: bytes) -> None:
    """Make the value written to ``tmp`` the value of the key named ``path``, for ``tenant``;
    the file of a previous tenant of the key goes."""
    old = _link_of(path)
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


def remove(path: Path) -> int | None:
    """Remove the key named ``path`` (and its tenant's file); its size, or None when absent."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        size = None  # absent, or a link whose file went
    old = _link_of(path)
    if not _unlink(path):
        return None
    if old is not None:
        _unlink(path.parent / old)
    return size


def tenant_at(path: Path) -> bytes | None:
    """The tenant of the key named ``path`` (b"" for a plain value; None when absent)."""
    old = _link_of(path)
    if old is not None:
        return tenant_of_link(old)
    return b"" if path.exists() else None


def stored_files(root: Path) -> list[Stored]:
    """Every stored value under ``root`` with its tenant; temporary, unlinked and foreign files
    are skipped. OSError when the directory cannot be read."""
    out = []
    for sub in os.scandir(root):
        if not sub.is_dir() or len(sub.name) != 2:
            continue
        for entry in os.scandir(sub.path):
            key = key_of(entry.name)
            if key is None or not entry.name.endswith(sub.name):
                continue
            tenant = tenant_of_link(_link_of(Path(entry.path)) or "") if entry.is_symlink() else b""
            if tenant is None:
                continue  # a link that is not ours
            try:
                out.append(Stored(key, tenant, entry.stat()))
            except FileNotFoundError:  # deleted meanwhile, or a link whose file went
                continue
    return out


def check_dir(root: Path, fix: bool = False) -> list[str]:
    """Files that do not belong under ``root``: leftover temporary files, tenant files no link
    points to (both when older than STALE_S), links to nothing, foreign files; removed with
    ``fix``."""
    problems, doomed = [], []
    now = time.time()
    for sub in os.scandir(root):
        if not sub.is_dir():
            if sub.name != MARKER:
                problems.append(f"foreign file: {sub.name}")
            continue
        try:
            entries = list(os.scandir(sub.path))
        except FileNotFoundError:  # removed since the listing above: nothing of the store's
            continue
        linked = {_link_of(Path(e.path)) for e in entries if e.is_symlink()}
        for entry in entries:
            try:
                problem = _problem(entry, sub.name, linked, now)
            except FileNotFoundError:  # renamed or removed since the scan (a live store)
                continue
            if problem:
                problems.append(f"{problem}: {sub.name}/{entry.name}")
                doomed.append(entry.path)
    for path in doomed if fix else ():
        _unlink(Path(path))
    return problems


def _problem(entry: os.DirEntry, bucket: str, linked: set, now: float) -> str | None:
    name = entry.name
    if key_of(name) is not None and name.endswith(bucket) and len(bucket) == 2:
        if not entry.is_symlink():
            return None
        try:
            target = os.readlink(entry.path)  # FileNotFoundError: gone since the scan
        except OSError:  # a plain value now (rewritten for no tenant since the scan)
            return None
        if tenant_of_link(target) is None:
            return "foreign link"
        if os.path.exists(entry.path) or _link_of(Path(entry.path)) != target:
            return None  # resolves, or was replaced or removed since
        return "link to a missing tenant file"
    recent = now - entry.stat(follow_symlinks=False).st_mtime < STALE_S  # gone: the caller skips it
    if is_tenant_file(name) and len(bucket) == 2:
        return None if name in linked or recent else "tenant file no key links to"
    if name.endswith(".tmp"):
        return None if recent else "leftover temporary file"  # maybe being written right now
    return "foreign file"


def _link_of(path: Path) -> str | None:
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


def set_atime(path: Path) -> None:
    """Record an access of the value named ``path`` now (through the link)."""
    try:
        st = os.stat(path)
        os.utime(path, ns=(time.time_ns(), st.st_mtime_ns))
    except FileNotFoundError:  # replaced or deleted meanwhile
        pass


def open_untouched(path: str, flags: int) -> int:
    """Open without the kernel's own access time update (``relatime`` records a first read),
    where the file is ours (O_NOATIME needs that)."""
    try:
        return os.open(path, flags | getattr(os, "O_NOATIME", 0))
    except PermissionError:
        return os.open(path, flags)
