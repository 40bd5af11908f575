"""A writer that forks (a worker pool, a data loader) after opening segments: its children
inherit the descriptors of the segment files it locks to say it still appends to them. A writer
killed while such a child lives on must still be seen as gone, so the process running beside it
seals the segments it left open."""

from __future__ import annotations

import os
import signal

from tests.backends.test_lmdb_multiprocess_compaction import N, child, kill, opened, said
from tests.backends.test_lmdb_segments import key, labelled, segment_records


def test_regression_a_child_the_writer_forked_kept_its_killed_parents_open_segment_from_being_sealed(tmp_path):
    db = tmp_path / "db"
    a = opened(db)
    proc = child(f"""
        b = LmdbBackend({str(db)!r}, capacity=64 * MiB, segment_bytes=MiB)
        for i in range(4):
            assert b.put_many([(key(i, "b"), labelled(key(i, "b"), 1, N))]) == [True]
        helper = os.fork()
        if helper == 0:  # lives on, beside the others, until the test ends it
            nowhere = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):  # (not its parent's pipes: they end when its parent dies)
                os.dup2(nowhere, fd)
            while True:
                time.sleep(3600)
        pause(f"{{helper}} {{b.values.files.open_segments()[0]}}")
    """)
    helper, segment = map(int, said(proc).split())
    try:
        kill(proc)
        assert not segment_records(a)[segment].sealed
        a.compact()  # looks for what processes that are gone left
        record = segment_records(a)[segment]
        assert record.sealed and record.owner_pid == 0, "a forked child kept its dead parent's segment open"
        assert a.get_many([key(i, "b") for i in range(4)]) == [labelled(key(i, "b"), 1, N) for i in range(4)]
    finally:
        os.kill(helper, signal.SIGKILL)
        a.close()
