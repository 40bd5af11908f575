"""``check --fix`` on a live file store while another process's delete_if_unchanged holds a value
under its tombstone (a temporary name) to compare it. The tombstone is a value renamed a moment
ago: it keeps the value's old mtime, and check judged temporary files by mtime, so it removed a
live tombstone as a leftover; the delete then lost the newer value it was to put back. Real files
under tmp_path; the interleaving is made by running check at the delete's read of its tombstone."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest

from storage_backends import cas_file, file_entries
from storage_backends.cas_file import delete_if_unchanged
from storage_backends.file_dir import FileBackend
from storage_backends.file_layout import file_of

KEY = b"\x07" * 16


def test_regression_check_fix_removed_a_live_tombstone_of_an_old_value_and_its_value_was_lost(
        tmp_path, monkeypatch):
    root = tmp_path / "files"
    with FileBackend(root) as b:
        b.put_many([(KEY, b"newer value")])
        long_ago = time.time() - 2 * file_entries.STALE_S  # written long ago, read (kept) since
        os.utime(file_of(root, KEY), (long_ago, long_ago))
        real_read, found = cas_file._read, []

        def check_fix_meanwhile(tomb):
            found.extend(b.check(fix=True))  # an operator's check --fix, while the value is away
            return real_read(tomb)

        monkeypatch.setattr(cas_file, "_read", check_fix_meanwhile)
        # the caller saw an older value: the one stored differs, so it goes back under its name
        assert delete_if_unchanged(b, [(KEY, b"older value")]) == [False]
        assert found == [], "check took the tombstone for a leftover temporary file"
        assert b.get_many([KEY]) == [b"newer value"]


def test_regression_a_changed_value_whose_link_back_the_file_system_refused_was_unlinked_and_lost(
        tmp_path, monkeypatch):
    # The value under its tombstone differed, so it goes back under its name; the link back was
    # refused (ENOSPC on btrfs, EMLINK, EIO: injected, none can be made here) and the tombstone was
    # unlinked all the same: the good value was gone. It is renamed back instead.
    import errno

    root = tmp_path / "files"
    with FileBackend(root) as b:
        b.put_many([(KEY, b"newer value")])

        def refused(src, dst, *, follow_symlinks=True):
            raise OSError(errno.EMLINK, "Too many links")

        monkeypatch.setattr(cas_file.os, "link", refused)
        assert delete_if_unchanged(b, [(KEY, b"older value")]) == [False]
        monkeypatch.undo()
        assert b.get_many([KEY]) == [b"newer value"]
        assert not [p for p in root.rglob("*") if p.name.endswith(".tmp")]


def _protected_hardlinks() -> bool:
    try:
        with open("/proc/sys/fs/protected_hardlinks") as fh:
            return fh.read().strip() == "1"
    except OSError:
        return False


@pytest.mark.skipif(os.geteuid() != 0 or not _protected_hardlinks(),
                    reason="needs root (to act as two users) and fs.protected_hardlinks = 1")
def test_regression_a_conditional_delete_of_another_users_unreadable_value_lost_it_where_hard_links_are_protected():
    # The everyday refusal of the link back, on real files: with fs.protected_hardlinks = 1 (the
    # default of most distributions) no user may link a file of another user it cannot read. A
    # conditional delete of such a value (a umask of 077, a directory several users share)
    # renamed it to its tombstone, could not judge it, and its link back was refused (EPERM):
    # the tombstone was unlinked, the value lost, and the batch failed with BackendUnavailable.
    with tempfile.TemporaryDirectory(dir="/tmp") as shared:
        os.chmod(shared, 0o755)  # (the other user passes through it)
        root = Path(shared) / "files"
        with FileBackend(root) as b:
            b.put_many([(KEY, b"theirs")])
            theirs = file_of(root, KEY)
            os.chmod(theirs.parent, 0o777)  # (a bucket every user writes in)
            os.chown(theirs, 1000, 1000)
            os.chmod(theirs, 0o600)  # (written under a umask of 077)
            os.seteuid(1001)  # (every thread of this process: the medium's act as this user)
            try:
                said = delete_if_unchanged(b, [(KEY, b"what another user saw")])
            finally:
                os.seteuid(0)
            assert said == [False]
            assert theirs.read_bytes() == b"theirs" and theirs.stat().st_uid == 1000
            assert [p.name for p in theirs.parent.iterdir()] == [theirs.name], "no tombstone left"
            assert b.counters().errors == 0
