"""The file medium with a directory under a key's name (an operator's, another program's): the
value of that key is refused, one counted miss said once in the log, and the rest of its batch
is stored; renaming a value over the directory failed the whole batch with EISDIR before. Real
directories under tmp_path."""

from __future__ import annotations

import logging
import os
import stat

from storage_backends import file_outcomes
from storage_backends.cas_file import delete_if_unchanged
from storage_backends.file_dir import FileBackend
from storage_backends.file_layout import file_of
from storage_backends.log_throttle import LogThrottle

SIZE = 1000


def key(i: int) -> bytes:
    return bytes([i]) * 16


def in_bucket(root, k: bytes) -> list[str]:
    return sorted(p.name for p in file_of(root, k).parent.iterdir())


def said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "no regular file" in r.getMessage()]


def test_regression_a_directory_under_one_keys_name_failed_the_whole_put_batch_with_eisdir(
        tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(file_outcomes, "_not_files", LogThrottle(file_outcomes.log))  # (a fresh minute)
    caplog.set_level(logging.WARNING, logger="storage_backends.file_outcomes")
    root = tmp_path / "files"
    with FileBackend(root) as b:
        b.put_many([(key(9), b"nine")])
        theirs = file_of(root, key(1))
        (theirs / "notes").mkdir(parents=True)  # someone's directory, with something in it
        items = [(key(1), b"one"), (key(2), b"two"), (key(3), b"three")]
        assert b.put_many(items) == [False, True, True]
        assert b.put_many(items) == [False, True, True]
        assert b.get_many([key(1), key(2), key(3)]) == [None, b"two", b"three"]
        assert b.contains_many([key(1), key(2)]) == [False, True]
        counted = b.counters()
        assert counted.errors == 0 and counted.put_rejected == 2 and counted.extra["put_not_a_file"] == 2
        assert (theirs / "notes").is_dir(), "the directory is left as it was"
        assert in_bucket(root, key(1)) == [theirs.name], "no temporary file left beside it"
    assert len(said(caplog)) == 1, "said once (a minute), not at every put"
    assert str(theirs) in said(caplog)[0]


def test_regression_a_tenants_put_over_a_directory_failed_its_batch_and_left_a_tenant_file_no_key_links_to(tmp_path):
    root = tmp_path / "files"
    with FileBackend(root) as b:
        file_of(root, key(1)).mkdir(parents=True)
        assert b.put_many([(key(1), b"one"), (key(2), b"two")], tenant=b"t") == [False, True]
        assert b.get_many([key(2)]) == [b"two"]
        assert in_bucket(root, key(1)) == [file_of(root, key(1)).name], "the tenant file went again"
        assert b.tenant_totals()[b"t"].entries == 1
        assert b.check() == [f"foreign directory: 01/{file_of(root, key(1)).name}"]


def test_a_bounded_store_counts_no_room_for_a_value_it_refused_for_a_directory(tmp_path):
    root = tmp_path / "files"
    with FileBackend(root, capacity=2 * SIZE) as b:
        file_of(root, key(1)).mkdir(parents=True)
        assert b.put_many([(key(1), b"a" * SIZE)]) == [False]
        assert b.put_many([(key(2), b"b" * SIZE), (key(3), b"c" * SIZE)]) == [True, True]
        assert b.counters().evictions == 0, "the refused value took no room in the medium's view"
        b.delete_many([key(1)])  # (a directory is never removed)
        assert file_of(root, key(1)).is_dir()


def test_regression_a_conditional_delete_renamed_a_directory_under_a_keys_name_away_and_failed_its_batch(tmp_path):
    # the directory was renamed to a tombstone, could not be linked back (EPERM) nor unlinked
    # (EISDIR): the batch was BackendUnavailable and the directory was left under a .tmp name
    root = tmp_path / "files"
    with FileBackend(root) as b:
        b.put_many([(key(2), b"two")])
        theirs = file_of(root, key(1))
        theirs.mkdir(parents=True)
        assert delete_if_unchanged(b, [(key(1), b""), (key(2), b"two")]) == [False, True]
        assert theirs.is_dir() and in_bucket(root, key(1)) == [theirs.name]
        assert b.get_many([key(2)]) == [None]


def test_regression_a_socket_under_a_keys_name_failed_the_whole_batch_of_a_presence_check_a_read_and_a_conditional_delete(
        tmp_path):
    # opening a socket is ENXIO, which was no miss: contains_many (it opens a value as a read does
    # since it agrees with reads; it said False before), get_many and delete_if_unchanged failed
    # their whole batch with BackendUnavailable
    root = tmp_path / "files"
    with FileBackend(root) as b:
        b.put_many([(key(2), b"two"), (key(3), b"three")])
        theirs = file_of(root, key(1))
        theirs.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(theirs, stat.S_IFSOCK | 0o600)  # (a socket's file, as bind(2) leaves one)
        assert b.contains_many([key(1), key(2)]) == [False, True]
        assert b.get_many([key(1), key(2)]) == [None, b"two"]
        assert delete_if_unchanged(b, [(key(1), b""), (key(3), b"three")]) == [False, True]
        assert stat.S_ISSOCK(theirs.lstat().st_mode), "left as it was, under its name"
        assert in_bucket(root, key(1)) == [theirs.name]
        assert b.counters().errors == 0


def test_regression_a_file_under_a_buckets_name_failed_every_put_and_delete_batch_holding_one_of_its_keys(
        tmp_path, monkeypatch, caplog):
    """A plain file where a bucket directory belongs (an operator's, a bad copy's): every key of
    that bucket is a miss, its values refused (counted, said once) and its deletes find nothing;
    the rest of each batch goes on. ``makedirs`` raised EEXIST (a fresh process) and opening the
    temporary file ENOTDIR (the bucket made earlier by this one), each failing the whole batch."""
    monkeypatch.setattr(file_outcomes, "_not_files", LogThrottle(file_outcomes.log))
    caplog.set_level(logging.WARNING, logger="storage_backends.file_outcomes")
    root = tmp_path / "files"
    bucket = file_of(root, key(1)).parent
    assert file_of(root, key(2)).parent != bucket
    with FileBackend(root) as b:
        b.put_many([(key(1), b"one")])  # the bucket is made, and known to this process
        for entry in bucket.iterdir():
            entry.unlink()
        bucket.rmdir()
        bucket.write_bytes(b"not a directory")
        items = [(key(1), b"one"), (key(2), b"two")]
        assert b.put_many(items) == [False, True]
        assert b.get_many([key(1), key(2)]) == [None, b"two"]
        assert b.delete_many([key(1), key(2)]) == 1
    with FileBackend(root) as fresh:  # a process that has made no bucket yet
        assert fresh.put_many(items) == [False, True]
        counted = fresh.counters()
        assert counted.errors == 0 and counted.extra["put_not_a_file"] == 1
    assert bucket.read_bytes() == b"not a directory", "the file is left as it was"
    told = [r.getMessage() for r in caplog.records if "is no directory" in r.getMessage()]
    assert len(told) == 1 and str(bucket) in told[0]


def a_file_for_a_bucket(root, k: bytes):
    """The bucket of ``k`` (its values dropped) replaced by a plain file; the bucket's path."""
    bucket = file_of(root, k).parent
    for entry in bucket.iterdir():
        entry.unlink()
    bucket.rmdir()
    bucket.write_bytes(b"not a directory")
    return bucket


def test_regression_puts_of_a_bucket_failed_every_batch_once_the_file_in_its_place_was_removed(tmp_path):
    """The warning says the bucket's values are refused until the file is removed; in a process
    that had made the bucket before, every batch holding one of its keys failed with ENOENT after
    the removal (the bucket was taken as made), until the process restarted."""
    root = tmp_path / "files"
    with FileBackend(root) as b:
        b.put_many([(key(1), b"one")])  # the bucket is made, and known to this process
        bucket = a_file_for_a_bucket(root, key(1))
        items = [(key(1), b"one"), (key(2), b"two")]
        assert b.put_many(items) == [False, True]
        bucket.unlink()  # the operator removes it, as told
        assert b.put_many(items) == [True, True]
        assert b.get_many([key(1), key(2)]) == [b"one", b"two"]
        assert b.counters().errors == 0


def test_regression_a_conditional_delete_failed_its_whole_batch_on_a_file_where_a_bucket_belongs(tmp_path):
    """delete_if_unchanged found ENOTDIR asking whether a key's name was a directory, and failed
    its batch (the other keys' deletes undone); a key under such a bucket holds nothing."""
    root = tmp_path / "files"
    with FileBackend(root) as b:
        b.put_many([(key(1), b"one"), (key(2), b"two")])
        bucket = a_file_for_a_bucket(root, key(1))
        assert delete_if_unchanged(b, [(key(1), b"one"), (key(2), b"two")]) == [False, True]
        assert b.get_many([key(2)]) == [None]
        assert b.counters().errors == 0
    assert bucket.read_bytes() == b"not a directory"
