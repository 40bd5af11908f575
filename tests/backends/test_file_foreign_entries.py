"""What the file medium finds under its names that it did not write: a link pointing outside
the store (to /etc/passwd), a directory, a foreign directory beside its buckets, a file of
another user. Never read as a value, never followed for a delete, never an error for the whole
batch; ``check`` reports them and ``fix`` removes only files, as they were judged. Real files
under tmp_path."""

from __future__ import annotations

import os

import pytest

from storage_backends.cas_file import delete_if_unchanged
from storage_backends.file_dir import FileBackend
from storage_backends.file_entries import target_of
from storage_backends.file_layout import file_of

A = b"tenant-a"
SECRET = b"root:x:0:0:root:/root:/bin/bash\n"


def key(i: int) -> bytes:
    return bytes([i]) * 16


@pytest.fixture
def outside(tmp_path):
    path = tmp_path / "passwd"
    path.write_bytes(SECRET)
    return path


def link_out(root, k: bytes, to) -> None:
    name = file_of(root, k)
    name.parent.mkdir(exist_ok=True)
    os.symlink(to, name)


@pytest.mark.parametrize("how", ["absolute", "relative"])
def test_a_link_to_a_file_outside_the_store_is_never_read_nor_deleted(tmp_path, outside, how):
    root = tmp_path / "files"
    to = str(outside) if how == "absolute" else "../../passwd"
    with FileBackend(root) as b:
        b.put_many([(key(9), b"ours")])
        for i in (1, 2, 3, 4, 5):
            link_out(root, key(i), to)
        assert b.get_many([key(1), key(9)]) == [None, b"ours"]
        assert b.contains_many([key(1)]) == [False]
        assert sorted(b.scan()) == [key(9)]
        assert b.entry_meta(key(1)) is None
        b.delete_many([key(2)])
        b.put_many([(key(3), b"mine now")], tenant=A)
        b.put_many([(key(4), b"mine now")])
        assert delete_if_unchanged(b, [(key(5), SECRET)]) == [False]
        assert outside.read_bytes() == SECRET
        assert b.get_many([key(3), key(4)]) == [b"mine now"] * 2
        assert sorted(b.check()) == [f"foreign link: 0{i}/{file_of(root, key(i)).name}" for i in (1, 5)]
        b.check(fix=True)
        assert b.check() == [] and outside.read_bytes() == SECRET


def test_a_tenant_file_that_is_a_link_is_never_read(tmp_path, outside):
    root = tmp_path / "files"
    with FileBackend(root) as b:
        b.put_many([(key(1), b"ours")], tenant=A)
        held = target_of(file_of(root, key(1)), A)
        held.unlink()
        os.symlink(outside, held)
        assert b.get_many([key(1)]) == [None]
        assert b.contains_many([key(1)]) == [False]
        assert list(b.scan()) == []
        assert b.check() == [f"foreign link: 01/{held.name}"]


def test_a_directory_under_a_keys_name_is_a_miss_not_an_error_for_the_batch(tmp_path):
    root = tmp_path / "files"
    with FileBackend(root) as b:
        b.put_many([(key(1), b"one"), (key(2), b"two")])
        os.unlink(file_of(root, key(1)))
        file_of(root, key(1)).mkdir()
        (file_of(root, key(1)) / "inside").write_bytes(b"x")
        assert b.get_many([key(1), key(2)]) == [None, b"two"]
        assert b.contains_many([key(1), key(2)]) == [False, True]
        assert list(b.scan()) == [key(2)]
        assert b.stats().entries == 1
        assert b.delete_many([key(1)]) == 0
        expected = [f"foreign directory: 01/{file_of(root, key(1)).name}"]
        assert b.check(fix=True) == expected
        assert b.check() == expected  # reported, never removed
        assert (file_of(root, key(1)) / "inside").read_bytes() == b"x"


def test_check_fix_never_walks_into_nor_empties_a_foreign_directory(tmp_path):
    root = tmp_path / "files"
    with FileBackend(root) as b:
        b.put_many([(key(1), b"one")])
        (root / "lost+found").mkdir()
        (root / "lost+found" / "someone's file").write_bytes(b"keep")
        (root / "01" / "a directory").mkdir()
        expected = ["foreign directory: 01/a directory", "foreign directory: lost+found"]
        assert sorted(b.check(fix=True)) == expected
        assert (root / "lost+found" / "someone's file").read_bytes() == b"keep"
        assert (root / "01" / "a directory").is_dir()
        assert b.get_many([key(1)]) == [b"one"]


@pytest.mark.parametrize("tenant", [b"", A])
def test_check_fix_keeps_a_value_put_after_its_dangling_link_was_judged(tmp_path, monkeypatch, tenant):
    root = tmp_path / "files"
    name = file_of(root, key(1))
    with FileBackend(root) as ours, FileBackend(root) as writer:
        ours.put_many([(key(1), b"old")], tenant=A)
        target_of(name, A).unlink()  # its tenant file lost (a crash): the link leads nowhere
        real = {f: getattr(os, f) for f in ("unlink", "rename")}
        left = [1]

        def before_the_fix_removes_it(f):
            def call(src, *args, **kwargs):
                if left[0] and os.fspath(src) == os.fspath(name):
                    left[0] = 0
                    writer.put_many([(key(1), b"put meanwhile")], tenant=tenant)
                return real[f](src, *args, **kwargs)
            return call

        for f in real:
            monkeypatch.setattr(os, f, before_the_fix_removes_it(f))
        assert ours.check(fix=True) == [f"link to a missing tenant file: 01/{name.name}"]
        assert left == [0]
        assert ours.get_many([key(1)]) == [b"put meanwhile"]


def test_a_hit_on_a_file_of_another_user_is_read_though_its_access_time_stays(tmp_path, monkeypatch):
    root = tmp_path / "files"
    with FileBackend(root) as b:
        b.put_many([(key(1), b"one"), (key(2), b"two")])

        def not_the_owner(*args, **kwargs):
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(os, "utime", not_the_owner)  # (files of another replica's user)
        assert b.get_many([key(1), key(2)]) == [b"one", b"two"]


def test_check_fix_does_not_delete_a_foreign_file_beside_the_buckets(tmp_path):
    # a file in the store's directory that is not the store's (an operator's notes, another
    # program's file) is reported, as before; fix removed it since fix walked the top level
    root = tmp_path / "files"
    with FileBackend(root) as b:
        b.put_many([(key(1), b"one")])
        (root / "NOTES.txt").write_text("an operator's notes")
        assert b.check(fix=True) == ["foreign file: NOTES.txt"]
        assert (root / "NOTES.txt").read_text() == "an operator's notes"
        assert b.get_many([key(1)]) == [b"one"]
