"""The segment descriptors that writers, readers and compaction share
(:class:`storage_backends.segment_fds.Descriptors`) against another thread closing them: a
descriptor is looked at only while held (closed under the look, its number could be the next
``open``'s, another file's), and none opened while the set closes outlives it. The other
thread's step is run where it interleaves (inside the ``fstat`` or ``open`` of the first);
real files under tmp_path."""

from __future__ import annotations

import errno
import os

import pytest

from storage_backends.segment_fds import Descriptors


def test_regression_deleted_looked_at_a_descriptor_another_thread_closed_and_the_next_open_reused(
        tmp_path, monkeypatch):
    # deleted() (whether a writer's open segment was deleted behind its back) fstat-ed the cached
    # descriptor without holding it: closed meanwhile (an idle sweep, a forget) and its number
    # reused by an open of another segment, it answered for that file: "not deleted".
    def path_of(segment: int):
        return tmp_path / f"{segment:016x}.seg"

    fds = Descriptors(path_of)
    fds.create(1)
    path_of(2).write_bytes(b"another segment")
    os.unlink(path_of(1))
    fstat, opened = os.fstat, []

    def closed_and_reused_meanwhile(fd):
        monkeypatch.setattr(os, "fstat", fstat)
        fds.forget(1)  # another thread: segment 1's descriptor goes
        opened.append(os.open(path_of(2), os.O_RDONLY))  # and the next open may take its number
        return fstat(fd)

    monkeypatch.setattr(os, "fstat", closed_and_reused_meanwhile)
    assert fds.deleted(1) is True
    assert opened, "the other thread's step did not run"
    os.close(opened[0])
    fds.close()


@pytest.mark.parametrize("how", ["hold", "create"])
def test_regression_a_descriptor_opened_while_another_thread_closed_the_set_was_never_closed(
        tmp_path, monkeypatch, how):
    def path_of(segment: int):
        return tmp_path / f"{segment:016x}.seg"

    path_of(2).write_bytes(b"a segment")
    fds = Descriptors(path_of)
    real_open, got = os.open, []

    def closed_meanwhile(path, flags, mode=0o777):
        monkeypatch.setattr(os, "open", real_open)
        fds.close()  # another thread closes the backend
        got.append(real_open(path, flags, mode))
        return got[-1]

    monkeypatch.setattr(os, "open", closed_meanwhile)
    with pytest.raises(OSError) as refused:
        fds.hold(2) if how == "hold" else fds.create(3)
    assert refused.value.errno == errno.EBADF
    assert got, "the other thread's step did not run"
    with pytest.raises(OSError) as gone:
        os.fstat(got[0])
    assert gone.value.errno == errno.EBADF, "the descriptor opened meanwhile stayed open"
