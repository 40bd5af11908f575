"""Owners of the LMDB tier's open segment files across pid namespaces (containers): a writer
appends to segments of its own and locks each file while it does; a writer that opens the
directory seals the segments of owners that are gone, and never those of an owner still running,
whatever namespace it runs in. Real child interpreters, killed with SIGKILL; another namespace is
the child's own claim (its records name another pid namespace, as the next container's would)."""

from __future__ import annotations

import fcntl
import os
import signal

from storage_backends.lmdb_disk import LmdbBackend
from tests.backends.test_lmdb_segments import KiB, MiB, blob, child, key, segment_records

OTHER_NAMESPACE = """
    import storage_backends.lmdb_segments as segments
    real = segments.pid_namespace
    segments.pid_namespace = lambda: real() + 12345  # the records say: another container
"""


def writer_in_another_namespace(db) -> tuple[object, int]:
    """A child of another pid namespace that put 4 values and holds its segment open, and that
    segment's id."""
    proc = child(OTHER_NAMESPACE + f"""
    b = LmdbBackend({str(db)!r}, capacity=64 * MiB, segment_bytes=MiB)
    for i in range(4):
        assert b.put_many([(key(i), blob(i, 200 * KiB))]) == [True]
    print(*b.values.files.open_segments(), flush=True)
    time.sleep(600)
    """)
    return proc, int(proc.stdout.readline())


def test_regression_a_writer_of_another_pid_namespace_killed_with_its_segment_open_left_it_on_disk_for_good(
        tmp_path):
    db = tmp_path / "db"
    proc, segment = writer_in_another_namespace(db)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    path = db / "segments" / f"{segment:016x}.seg"

    b = LmdbBackend(db, capacity=64 * MiB, segment_bytes=MiB)  # the engine's next container
    record = segment_records(b)[segment]
    assert record.sealed and record.owner_pid == 0, "a dead owner's segment stayed open"
    assert b.get_many([key(i) for i in range(4)]) == [blob(i, 200 * KiB) for i in range(4)]
    assert b.delete_many([key(i) for i in range(4)]) == 4
    assert not path.exists(), "the drained segment of a dead owner kept its file"
    assert b.stats().extra["segment_files"] == 0 and b.check() == []
    b.close()


def test_a_running_writer_of_another_pid_namespace_keeps_its_open_segment(tmp_path):
    db = tmp_path / "db"
    proc, segment = writer_in_another_namespace(db)
    try:
        b = LmdbBackend(db, capacity=64 * MiB, segment_bytes=MiB)
        record = segment_records(b)[segment]
        assert not record.sealed and record.owner_pid == proc.pid
        assert b.delete_many([key(i) for i in range(4)]) == 4
        assert (db / "segments" / f"{segment:016x}.seg").exists() and b.check() == []
        b.close()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)


def test_a_writer_locks_only_the_segments_it_still_appends_to(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=64 * MiB, segment_bytes=MiB)
    for i in range(12):  # 2.4 MiB: three segments, two of them sealed
        assert b.put_many([(key(i), blob(i, 200 * KiB))]) == [True]
    (open_segment,) = b.values.files.open_segments()
    records = segment_records(b)
    assert len(records) == 3 and [s for s, r in records.items() if not r.sealed] == [open_segment]
    assert {s: locked(b.values.files.path_of(s)) for s in records} == {s: s == open_segment for s in records}
    b.close()
    assert not locked(b.values.files.path_of(open_segment))


def locked(path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
