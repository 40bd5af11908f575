"""Presence on the file medium agrees with what a read serves: a value another user wrote with a
umask of 077 (this process may not open it) is a read's miss, and ``contains_many`` said True for
it, so the engine counted a hit its load then missed. Real permissions: as root the calls run
with the effective uid of ``nobody`` (the whole process, its threads too, for the call only);
as another user, the file's mode takes the owner's read right away."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path

import pytest

from storage_backends.file_dir import FileBackend
from storage_backends.file_entries import target_of
from storage_backends.file_layout import file_of

NOBODY = 65534


def key(i: int) -> bytes:
    return bytes([i]) * 16


@pytest.fixture
def shared_dir():
    """A directory every user may walk (pytest's own are root's alone), removed after."""
    top = Path(tempfile.mkdtemp(prefix="tiered-kv-shared-"))
    os.chmod(top, 0o755)
    try:
        yield top
    finally:
        for p in sorted(top.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            p.unlink() if not p.is_dir() or p.is_symlink() else p.rmdir()
        top.rmdir()


def unreadable(path: Path) -> None:
    """``path`` as another user's umask of 077 leaves it, for this process."""
    os.chmod(path, 0o600 if os.geteuid() == 0 else 0o000)


@contextlib.contextmanager
def as_another_user():
    if os.geteuid() != 0:
        yield
        return
    try:
        os.seteuid(NOBODY)
    except PermissionError:
        pytest.skip("this root may not change its effective uid")
    try:
        yield
    finally:
        os.seteuid(0)


def test_regression_contains_said_an_unreadable_value_was_there_while_its_read_missed(shared_dir):
    root = shared_dir / "files"
    with FileBackend(root) as b:
        b.put_many([(key(1), b"one"), (key(2), b"two"), (key(3), b"three")])
        b.put_many([(key(4), b"four")], tenant=b"t")
        unreadable(file_of(root, key(2)))
        unreadable(target_of(file_of(root, key(4)), b"t"))  # (the tenant file; its link is readable)
        keys = [key(1), key(2), key(3), key(4)]
        with as_another_user():
            present = b.contains_many(keys)
            values = b.get_many(keys)
        assert values == [b"one", None, b"three", None]
        assert present == [v is not None for v in values], "presence as a read would serve"
        assert b.counters().errors == 0
        if os.geteuid() == 0:  # (root, as itself, reads them all)
            assert b.contains_many(keys) == [True] * 4


def test_contains_opens_a_value_but_never_reads_it(tmp_path):
    # a read sets the access time (the medium's recency); a presence check must not count as one
    root = tmp_path / "files"
    with FileBackend(root) as b:
        b.put_many([(key(1), b"x" * 4096)])
        path = file_of(root, key(1))
        long_ago = time.time_ns() - 2 * 86_400 * 10**9
        os.utime(path, ns=(long_ago, path.stat().st_mtime_ns))
        assert b.contains_many([key(1)]) == [True]
        assert path.stat().st_atime_ns == long_ago
