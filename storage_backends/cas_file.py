"""Delete-if-unchanged on the file medium, which has no lock shared by its processes: a key's
value file (the key's own file, or its tenant's file) is first renamed to a tombstone of this
call, a name no other process uses, then read and compared with the bytes the caller saw. Equal:
the tombstone is removed (and the key's link to it, when the key is a tenant's, if it still names
that file and nothing re-created it). Different: the file is linked back under its name unless
another was published there meanwhile (the newer value stays; the older is dropped).

Guarantees: a value published by any process after the rename is never deleted (it is a new
file; the rename took the old one). While a value that turned out changed is away (between the
rename and its link back), readers miss it (a counted miss, recomputed). Left behind at worst: a
tenant file no key links to (another tenant's put meanwhile), or a tombstone after a crash (a
temporary file: ``check`` reports both after ``file_entries.STALE_S`` and removes them with
``fix``). One race is left: a put of the same key for the same tenant that read the key's link
before the link was removed and replaces its tenant file right after leaves that file without a
link (a miss, reported by ``check``), never a wrong value."""

from __future__ import annotations

import errno
import itertools
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from storage_backends.file_entries import OPEN_FLAGS, link_of, put_back
from storage_backends.file_layout import as_key, file_of, temp_of, tenant_of_link
from tiered_kv.errors import BackendClosed, BackendUnavailable

_serials = itertools.count()


def delete_if_unchanged(backend, pairs: Sequence[tuple[bytes, bytes]]) -> list[bool]:
    """Delete each ``(key, value)`` of ``backend`` (a FileBackend) whose stored value is exactly
    ``value``; per pair whether it was deleted."""
    items = [(as_key(k), bytes(v)) for k, v in pairs]
    if backend._closed:
        raise BackendClosed(f"file backend at {backend.path} is closed")
    done: list[bool] = []
    try:
        for key, expected in items:
            done.append(_delete_one(file_of(backend.path, key), expected))
    except OSError as exc:
        backend._count(errors=1)
        raise BackendUnavailable(f"file store at {backend.path}: {exc}") from exc
    finally:
        gone = [k for (k, _), d in zip(items, done) if d]
        if backend._room is not None:
            backend._room.removed(gone)
        backend._count(deletes=len(gone))
        backend._tell("removed", gone)
    return done


def _delete_one(path: Path, expected: bytes) -> bool:
    link = link_of(path)
    if link is not None and tenant_of_link(link) is None:
        return False  # a link that is not ours (to /etc/passwd): never followed, never renamed
    held = path.parent / link if link is not None else path
    if _is_directory(held):
        return False  # never a value: renamed away, it could not be linked back (its batch failed)
    tomb = temp_of(path, f"cas{next(_serials)}")
    try:
        os.rename(held, tomb)
    except (FileNotFoundError, NotADirectoryError):  # (the latter: a file holds its bucket's name)
        return False  # gone, or its tenant changed since the link was read
    try:
        same = not os.path.islink(tomb) and _read(tomb) == expected
    except PermissionError:  # another user's value: not this process's to judge (reads miss it)
        same = False
    except BaseException:
        put_back(tomb, held)
        raise
    if not same:
        put_back(tomb, held)
        return False
    os.unlink(tomb)
    if link is not None:
        _drop_link(path, link)
    return True


def _drop_link(path: Path, name: str) -> None:
    """Remove the key's link ``path`` when it still names ``name`` and that file is gone."""
    tomb = temp_of(path, f"cas{next(_serials)}")
    try:
        os.rename(path, tomb)
    except FileNotFoundError:
        return
    if link_of(tomb) != name or (path.parent / name).exists():  # rewritten meanwhile
        put_back(tomb, path)
        return
    os.unlink(tomb)
    if (path.parent / name).exists():  # a put that read the link before published its file since
        try:
            os.symlink(name, path)
        except FileExistsError:  # (and another put its own link)
            pass


def _read(path: Path) -> bytes | None:
    """The bytes of the tombstone ``path``; None when it is no regular file (a named pipe under
    the key's name: opened without waiting for a writer, which used to wait for good; a socket,
    which cannot be opened: ENXIO failed the batch)."""
    try:
        fd = os.open(path, OPEN_FLAGS | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return None
        raise
    with os.fdopen(fd, "rb") as fh:
        return fh.read() if stat.S_ISREG(os.fstat(fd).st_mode) else None


def _is_directory(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):  # (the latter: no bucket, a file in its place)
        return False
