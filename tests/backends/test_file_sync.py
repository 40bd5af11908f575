"""``sync=true`` on the file medium: a put it acknowledged survives a machine crash, so the
renames naming the value are made durable too (the bucket directory after the rename, the
store's directory after a bucket is made), not only the value's bytes. Real files under
tmp_path; which directories were fsync'd is recorded at ``os.fsync``."""

from __future__ import annotations

import os

from storage_backends.file_dir import FileBackend
from storage_backends.file_layout import file_of

A = b"tenant-a"


def test_a_synced_put_fsyncs_the_directories_that_name_its_value(tmp_path, monkeypatch):
    root = tmp_path / "files"
    synced: list[int] = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.fstat(fd).st_ino)
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with FileBackend(root, sync=True) as b:
        assert b.put_many([(b"\x01" * 16, b"one")]) == [True]
        assert b.put_many([(b"\x02" * 16, b"two")], tenant=A) == [True]
        for k in (b"\x01" * 16, b"\x02" * 16):
            assert os.stat(file_of(root, k).parent).st_ino in synced
        assert os.stat(root).st_ino in synced
