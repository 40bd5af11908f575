"""The file medium while puts are in flight. Its capacity: a value admitted by one put is being
written until its put ends, and no other put (another thread's, or a later key of the same
batch) may evict it meanwhile: that eviction removed a file not there yet, the value landed
after it, and the directory held more than its capacity, unseen by the medium's view. Its
close: it waits for the calls running (they used to wait for good on the stopped event loop).
Real files under tmp_path; a put is held between its write and its rename (monkeypatched) until
the other side has acted, every run."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import threading

import pytest

from storage_backends import file_dir, file_layout
from storage_backends.file_dir import FileBackend
from storage_backends.file_layout import MARKER, file_of
from tiered_kv.errors import BackendClosed, BackendUnavailable

SIZE = 1000


def key(tag: bytes, i: int) -> bytes:
    return tag + bytes([i]) * 15


def on_disk(backend: FileBackend) -> int:
    return backend.stats().used_bytes  # (a listing of the directory)


def test_regression_a_put_evicted_another_threads_values_still_being_written_and_the_files_outgrew_capacity(
        tmp_path, monkeypatch):
    backend = FileBackend(tmp_path / "files", capacity=4 * SIZE)
    first, second = [key(b"a", i) for i in range(4)], [key(b"b", i) for i in range(4)]
    holding, go_on = threading.Event(), threading.Event()
    publish = file_dir._publish

    async def held_publish(tmp, path, tenant):  # the first put: written, not renamed yet
        if path.name.startswith("61"):
            holding.set()
            await asyncio.get_running_loop().run_in_executor(None, go_on.wait, 30)
        return await publish(tmp, path, tenant)

    monkeypatch.setattr(file_dir, "_publish", held_publish)
    answers = {}
    writer = threading.Thread(target=lambda: answers.update(first=backend.put_many([(k, b"a" * SIZE) for k in first])))
    writer.start()
    try:
        assert holding.wait(30)
        answers["second"] = backend.put_many([(k, b"b" * SIZE) for k in second])
    finally:
        go_on.set()
        writer.join(30)
    assert answers == {"first": [True] * 4, "second": [False] * 4}, "values still being written were evicted"
    assert on_disk(backend) <= backend.capacity
    assert backend.get_many(first) == [b"a" * SIZE] * 4
    assert backend.stats().evictions == 0
    assert backend.put_many([(k, b"b" * SIZE) for k in second]) == [True] * 4  # written now: they may go
    assert on_disk(backend) <= backend.capacity and backend.contains_many(first) == [False] * 4
    backend.close()


def test_regression_one_put_of_more_than_the_capacity_evicted_its_own_first_values_and_wrote_them_anyway(tmp_path):
    backend = FileBackend(tmp_path / "files", capacity=4 * SIZE)
    keys = [key(b"c", i) for i in range(8)]
    assert backend.put_many([(k, b"c" * SIZE) for k in keys]) == [True] * 4 + [False] * 4
    assert on_disk(backend) <= backend.capacity and backend.stats().evictions == 0
    assert backend.contains_many(keys) == [True] * 4 + [False] * 4
    backend.close()


def test_a_put_that_failed_lets_its_keys_be_evicted_again(tmp_path, monkeypatch):
    backend = FileBackend(tmp_path / "files", capacity=4 * SIZE)
    assert backend.put_many([(key(b"d", i), b"d" * SIZE) for i in range(4)]) == [True] * 4

    async def failed(tmp, path, tenant):  # (a full disk is no failure: a refused value, its room made)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(file_dir, "_publish", failed)
    with pytest.raises(BackendUnavailable, match="Input/output"):
        backend.put_many([(key(b"d", 0), b"D" * SIZE)])  # an overwrite the disk fails
    monkeypatch.undo()
    assert backend.put_many([(key(b"f", i), b"f" * SIZE) for i in range(4)]) == [True] * 4
    assert backend.contains_many([key(b"d", i) for i in range(4)]) == [False] * 4
    assert on_disk(backend) == 4 * SIZE
    backend.close()


# -- a close while calls run ----------------------------------------------------------------------
def held_put(backend: FileBackend, monkeypatch, answers: dict) -> tuple[threading.Thread, threading.Event]:
    """A thread whose put is held between its write and its rename until the event is set."""
    holding, go_on = threading.Event(), threading.Event()
    publish = file_dir._publish

    async def held_publish(tmp, path, tenant):
        holding.set()
        await asyncio.get_running_loop().run_in_executor(None, go_on.wait, 30)
        return await publish(tmp, path, tenant)

    monkeypatch.setattr(file_dir, "_publish", held_publish)

    def put():
        try:
            answers["put"] = backend.put_many([(key(b"g", 0), b"g" * SIZE)])
        except BackendClosed as exc:
            answers["put"] = exc

    writer = threading.Thread(target=put, daemon=True)
    writer.start()
    assert holding.wait(30)
    return writer, go_on


def test_regression_a_put_running_when_the_file_medium_closed_waited_for_good(tmp_path, monkeypatch):
    backend = FileBackend(tmp_path / "files")
    answers: dict = {}
    writer, go_on = held_put(backend, monkeypatch, answers)
    closer = threading.Thread(target=backend.close, daemon=True)
    closer.start()
    while not backend._closed:  # (the close has begun: it refuses new calls)
        threading.Event().wait(0.01)
    go_on.set()
    writer.join(30)
    closer.join(30)
    assert not writer.is_alive(), "the put never came back"
    assert answers["put"] == [True] and not closer.is_alive()
    with pytest.raises(BackendClosed):
        backend.get_many([key(b"g", 0)])
    with FileBackend(tmp_path / "files") as again:
        assert again.get_many([key(b"g", 0)]) == [b"g" * SIZE]


def test_a_close_that_cannot_wait_longer_gives_running_calls_backend_closed(tmp_path, monkeypatch):
    backend = FileBackend(tmp_path / "files")
    answers: dict = {}
    writer, go_on = held_put(backend, monkeypatch, answers)
    monkeypatch.setattr(file_dir, "CLOSE_WAIT_S", 0.0)
    try:
        backend.close()
        writer.join(30)
    finally:
        go_on.set()
    assert not writer.is_alive() and isinstance(answers["put"], BackendClosed)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another user needs root")
def test_regression_a_spent_disk_quota_evicted_other_users_values_for_nothing(tmp_path, monkeypatch):
    # EDQUOT was taken for a full disk: least recently used values went, in a directory several
    # users share other users' values too, which free none of this user's quota, and the put
    # failed again. Only this user's values go for a quota. (Quotas cannot be set up here: the
    # write's error is injected; the files are really another user's.)
    backend = FileBackend(tmp_path / "files", capacity=64 * SIZE)
    theirs = [key(b"q", i) for i in range(4)]
    assert backend.put_many([(k, b"q" * SIZE) for k in theirs]) == [True] * 4
    for k in theirs:
        os.chown(file_of(tmp_path / "files", k), 65534, 65534, follow_symlinks=False)

    async def over_quota(tmp, path, tenant):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    monkeypatch.setattr(file_dir, "_publish", over_quota)
    assert backend.put_many([(key(b"r", i), b"r" * SIZE) for i in range(2)]) == [False, False]
    monkeypatch.undo()
    stats = backend.stats()
    assert stats.evictions == 0 and stats.extra["put_over_quota"] == 2 and stats.extra["put_disk_full"] == 0
    assert backend.contains_many(theirs) == [True] * 4
    assert not list((tmp_path / "files").rglob("*.tmp"))
    backend.close()


def test_a_spent_quota_evicts_this_users_least_recently_used_values_and_writes_again(tmp_path, monkeypatch):
    # A store whose capacity is above its user's quota (one service account) keeps taking new
    # values: its own least recently used values go, as for a full disk.
    backend = FileBackend(tmp_path / "files", capacity=64 * SIZE)
    old = [key(b"o", i) for i in range(4)]
    assert backend.put_many([(k, b"o" * SIZE) for k in old]) == [True] * 4
    publish, refused = file_dir._publish, set()

    async def over_quota_once(tmp, path, tenant):
        if path not in refused:  # (the quota has room again once values went)
            refused.add(path)
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        return await publish(tmp, path, tenant)

    monkeypatch.setattr(file_dir, "_publish", over_quota_once)
    new = [(key(b"n", i), b"n" * SIZE) for i in range(2)]
    assert backend.put_many(new) == [True, True]
    monkeypatch.undo()
    stats = backend.stats()
    assert stats.evictions == 2 and stats.extra["put_over_quota"] == 0
    assert backend.contains_many(old) == [False, False, True, True]  # (the least recently used went)
    assert backend.get_many([k for k, _ in new]) == [v for _, v in new]
    backend.close()


def test_regression_a_spent_disk_quota_as_the_marker_said_format_2_failed_a_tenants_whole_batch(tmp_path, monkeypatch):
    # A store of format 1 writes format 2 into its marker before a tenant's first value. EDQUOT
    # there (no full disk since a spent quota is its own refusal) was no refusal at all: the batch
    # failed with BackendUnavailable, counted an error. The tenant's values are refused (counted
    # put_over_quota) after this user's values made room in vain, and the marker is written once
    # the quota allows.
    root = tmp_path / "files"
    FileBackend(root).close()
    (root / MARKER).write_text(json.dumps({"format": 1}))
    with FileBackend(root, capacity=64 * SIZE) as backend:
        assert backend.put_many([(key(b"s", i), b"s" * SIZE) for i in range(4)]) == [True] * 4  # (no tenant)

        def over_quota(path, data):
            raise OSError(errno.EDQUOT, "Disk quota exceeded")

        monkeypatch.setattr(file_layout, "write_synced", over_quota)
        tenants = [(key(b"t", i), b"t" * SIZE) for i in range(2)]
        assert backend.put_many(tenants, tenant=b"t") == [False, False]
        stats = backend.stats()
        assert stats.errors == 0
        assert stats.extra["put_over_quota"] == 2 and stats.extra["put_disk_full"] == 0
        monkeypatch.undo()
        assert backend.put_many(tenants, tenant=b"t") == [True, True]
        assert json.loads((root / MARKER).read_text()) == {"format": 2}
