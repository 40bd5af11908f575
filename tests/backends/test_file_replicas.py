"""Replicas sharing one file store directory (a shared filesystem mounted by several hosts or
containers): the store they create at the same moment, and a value two of them write at once.
Real files under tmp_path; the other replica is another process (spawn) or thread."""

from __future__ import annotations

import multiprocessing
import os
import threading
import types

from storage_backends.file_dir import FileBackend
from storage_backends.file_layout import file_of, open_store

KEY = bytes(range(16))
OURS, THEIRS = b"o" * (1 << 20), b"t" * (1 << 20)


def _replica_with_our_pid_and_thread(root, pid, thread, ready, go) -> None:
    """Another host's replica that happens to run with our pid and thread id (containers):
    its put of KEY is half-written when ours runs, and ends after it."""
    from storage_backends import file_layout

    os.getpid = lambda: pid
    file_layout.threading = types.SimpleNamespace(get_ident=lambda: thread)
    path = file_of(root, KEY)
    path.parent.mkdir(exist_ok=True)
    tmp = file_layout.temp_of(path, 0)  # its first put, as ours
    with open(tmp, "wb") as fh:
        fh.write(THEIRS[: len(THEIRS) // 2])
        fh.flush()
        ready.set()
        go.wait(60)
        fh.write(THEIRS[len(THEIRS) // 2:])
    try:
        os.replace(tmp, path)
    except FileNotFoundError:  # (its temporary file was taken)
        pass


def test_a_value_two_replicas_write_at_once_is_never_a_mix_of_their_bytes(tmp_path):
    root = tmp_path / "files"
    ctx = multiprocessing.get_context("spawn")
    ready, go = ctx.Event(), ctx.Event()
    with FileBackend(root) as ours:
        other = ctx.Process(target=_replica_with_our_pid_and_thread,
                            args=(root, os.getpid(), ours._thread.ident, ready, go))
        other.start()
        try:
            assert ready.wait(60)
            assert ours.put_many([(KEY, OURS)]) == [True]
        finally:
            go.set()
            other.join(60)
        assert other.exitcode == 0
        assert ours.get_many([KEY])[0] in (OURS, THEIRS)


def test_replicas_creating_the_store_at_the_same_moment_are_never_refused(tmp_path):
    refused = []
    for attempt in range(60):  # (a refusal came in about one attempt in three)
        root = tmp_path / f"store{attempt}"
        start = threading.Barrier(4)

        def replica(root=root, start=start) -> None:
            start.wait()
            try:
                open_store(root, True)
            except Exception as exc:  # noqa: BLE001 - the refusal is what is looked for
                refused.append(exc)

        replicas = [threading.Thread(target=replica) for _ in range(4)]
        for t in replicas:
            t.start()
        for t in replicas:
            t.join()
    assert refused == []
