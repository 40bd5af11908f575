"""``check`` of the file medium while another process writes and deletes in the same directory:
whatever it renamed or removed between the walk's scan and its look at an entry was never a
problem of the store, so it is skipped, and ``fix`` removes nothing of the other process's. Real
files under tmp_path; the other process's moves happen at that exact point every run."""

from __future__ import annotations

import os

from storage_backends.file_dir import FileBackend
from storage_backends.file_entries import target_of
from storage_backends.file_layout import file_of, temp_of
from tests.backends.helpers import after_listing

A = b"tenant-a"
BUCKET = b"\x2a"  # every key below ends in it: one bucket, one listing


def key(i: int) -> bytes:
    return bytes([i]) * 15 + BUCKET


def test_regression_check_raised_file_not_found_for_files_another_process_moved_mid_walk(tmp_path, monkeypatch):
    root = tmp_path / "files"
    with FileBackend(root) as ours, FileBackend(root) as writer:
        writer.put_many([(key(1), b"deleted meanwhile"), (key(2), b"rewritten for no tenant")], tenant=A)
        writer.put_many([(key(3), b"kept")], tenant=A)
        arriving = temp_of(target_of(file_of(root, key(4)), A), 0)  # a put half-way, fresh
        arriving.write_bytes(b"arrives meanwhile")
        link = temp_of(file_of(root, key(4)), "link")
        os.symlink(target_of(file_of(root, key(4)), A).name, link)

        def the_writer_goes_on():
            assert writer.delete_many([key(1)]) == 1  # its link and its tenant file go
            writer.put_many([(key(2), b"now no tenant's")])  # its link becomes a plain file
            os.replace(arriving, target_of(file_of(root, key(4)), A))  # the put of key 4 ends
            os.replace(link, file_of(root, key(4)))

        after_listing(monkeypatch, file_of(root, key(1)).parent, the_writer_goes_on)
        assert ours.check(fix=True) == []
        assert ours.check() == []
        assert writer.get_many([key(i) for i in (1, 2, 3, 4)]) == \
            [None, b"now no tenant's", b"kept", b"arrives meanwhile"]
