"""The file medium's marker (the file saying a directory is a file store). It was written and
named without an fsync of it or of its directory: a crash right after a store was made could
leave it empty, and the store then refused to open ("unreadable marker"). It is written whole,
fsync'd, then named, and the directory fsync'd (recorded at ``os.fsync``: which inodes, and
whether the marker had its name yet); an empty or cut marker an older version's crash left is
rewritten as the store opens (the directory's marker name says it is a store, and every
version's values are format 2's); a marker of other bytes is a ConfigError naming the file and
what to do. Real directories under tmp_path (and a read-only tmpfs where it can be mounted)."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat

import pytest

from storage_backends.file_dir import FileBackend
from storage_backends.file_layout import MARKER, file_of
from tests.backends.mounts import remount_read_only, small_tmpfs
from tiered_kv.errors import ConfigError


def key(i: int) -> bytes:
    return bytes([i]) * 16


class Fsyncs(list):
    """(inode, size, the inode named as the marker then) of every fsync'd file, in order; the
    marker is looked for in the directory given to :meth:`watch`."""

    def __init__(self) -> None:
        super().__init__()
        self.watched = None

    def watch(self, directory) -> None:
        self.watched = directory

    def marker(self) -> int | None:
        try:
            return (self.watched / MARKER).stat().st_ino if self.watched is not None else None
        except FileNotFoundError:
            return None


@pytest.fixture
def fsyncs(monkeypatch):
    seen = Fsyncs()
    real = os.fsync

    def fsync(fd):
        st = os.fstat(fd)
        seen.append((st.st_ino, st.st_size, seen.marker()))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def test_regression_a_new_file_stores_marker_was_not_fsynced_so_a_crash_could_leave_it_empty(tmp_path, fsyncs):
    root = tmp_path / "made" / "files"
    fsyncs.watch(root)
    FileBackend(root).close()
    marker = (root / MARKER).stat()
    assert (marker.st_ino, marker.st_size, None) in fsyncs, "its bytes on disk before it has its name"
    assert (root.stat().st_ino, root.stat().st_size, marker.st_ino) in fsyncs, "its name on disk (the directory)"
    assert any(ino == root.parent.stat().st_ino for ino, _, _ in fsyncs), "the new store's own name"


def test_regression_a_marker_upgraded_for_a_tenant_was_not_fsynced(tmp_path, fsyncs):
    root = tmp_path / "files"
    FileBackend(root).close()
    (root / MARKER).write_text(json.dumps({"format": 1}))  # a store of the version before tenants
    old = (root / MARKER).stat().st_ino
    fsyncs.watch(root)
    with FileBackend(root) as b:
        b.put_many([(key(1), b"one")], tenant=b"t")
    marker = (root / MARKER).stat()
    assert json.loads((root / MARKER).read_text()) == {"format": 2}
    assert old != marker.st_ino and (marker.st_ino, marker.st_size, old) in fsyncs, "bytes first"
    assert any(ino == root.stat().st_ino and named == marker.st_ino for ino, _, named in fsyncs)


@pytest.mark.parametrize("left", [b"", b"\0" * 13, b'{"form', b'{"format": 2'], ids=["empty", "zeros", "cut", "cut-late"])
def test_regression_an_empty_marker_a_crash_left_made_the_store_unopenable(tmp_path, left, caplog):
    root = tmp_path / "files"
    with FileBackend(root) as b:
        b.put_many([(key(1), b"one")])
    (root / MARKER).write_bytes(left)
    caplog.set_level(logging.WARNING, logger="storage_backends.file_layout")
    with FileBackend.open_read_only(f"file://{root}") as b:  # (a tool's read-only open writes nothing)
        assert b.get_many([key(1)]) == [b"one"]
    assert (root / MARKER).read_bytes() == left
    assert any(str(root / MARKER) in r.getMessage() and "left as it is" in r.getMessage() for r in caplog.records)
    with FileBackend(root, sync=True) as b:  # an engine's open
        assert b.get_many([key(1)]) == [b"one"]
    assert json.loads((root / MARKER).read_text()) == {"format": 2}, "rewritten whole"
    assert any(str(root / MARKER) in r.getMessage() and "rewritten" in r.getMessage() for r in caplog.records)
    assert not [p for p in root.iterdir() if p.name.endswith(".tmp")]
    with FileBackend(root) as b:
        assert b.put_many([(key(2), b"two")], tenant=b"t") == [True] and b.check() == []


def test_a_marker_of_other_bytes_is_refused_naming_the_file_and_what_to_do(tmp_path):
    root = tmp_path / "files"
    FileBackend(root).close()
    (root / MARKER).write_text("this is not ours")
    with pytest.raises(ConfigError) as refused:
        FileBackend(root)
    said = str(refused.value)
    assert str(root / MARKER) in said and '{"format": 2}' in said
    assert (root / MARKER).read_text() == "this is not ours", "left as it was"


def test_an_empty_marker_on_a_read_only_mount_opens_as_it_is(tmp_path, caplog):
    with small_tmpfs(tmp_path / "disk", "1m") as mnt:
        root = mnt / "files"
        with FileBackend(root) as b:
            b.put_many([(key(1), b"one")])
        (root / MARKER).write_bytes(b"")
        remount_read_only(mnt)
        caplog.set_level(logging.WARNING, logger="storage_backends.file_layout")
        with FileBackend(root) as b:  # (an engine's open: it would rewrite the marker)
            assert b.get_many([key(1)]) == [b"one"] and b.contains_many([key(1)]) == [True]
        assert (root / MARKER).read_bytes() == b""
        assert any("cannot be rewritten" in r.getMessage() for r in caplog.records)
        assert file_of(root, key(1)).exists()


def test_regression_a_file_system_that_cannot_fsync_a_directory_refused_new_stores_and_tenant_puts(tmp_path, monkeypatch):
    # Some FUSE and SMB mounts answer a directory's fsync with EINVAL: the marker's new durable
    # write made every store on them unmakeable once, and every tenant put to an older store
    # failed. (Such a mount is not available here: the refusal is injected for directories.)
    real = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    root = tmp_path / "files"
    FileBackend(root).close()
    (root / MARKER).write_text(json.dumps({"format": 1}))
    with FileBackend(root) as b:
        assert b.put_many([(key(1), b"one")], tenant=b"t") == [True]
        assert b.get_many([key(1)]) == [b"one"]
