"""A writer that forks (a worker pool, a data loader) after opening segments: its children
inherit the descriptors of the segment files it locks to say it still appends to them. A writer
killed while such a child lives on must still be seen as gone, so the process running beside it
seals the segments it left open."""

from __future__ import annotations

import os
import signal
import textwrap

from tests.backends.helpers import compaction_beside
from tests.backends.test_lmdb_multiprocess_compaction import (
    N,
    assert_values,
    child,
    kill,
    opened,
    said,
)
from tests.backends.test_lmdb_segments import key, labelled, segment_records

LIVES_ON = """
helper = os.fork()
if helper == 0:  # lives on, beside the others, until the test ends it
    nowhere = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # (not its parent's pipes: they end when its parent dies)
        os.dup2(nowhere, fd)
    while True:
        time.sleep(3600)
"""


def forks_a_helper(indent: int) -> str:
    """A child's lines forking a process that outlives it (``helper``: its pid), at ``indent``."""
    return textwrap.indent(LIVES_ON.strip(), " " * indent).strip()


def test_regression_a_child_the_writer_forked_kept_its_killed_parents_open_segment_from_being_sealed(tmp_path):
    db = tmp_path / "db"
    a = opened(db)
    proc = child(f"""
        b = LmdbBackend({str(db)!r}, capacity=64 * MiB, segment_bytes=MiB)
        for i in range(4):
            assert b.put_many([(key(i, "b"), labelled(key(i, "b"), 1, N))]) == [True]
        {forks_a_helper(8)}
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


def test_regression_a_child_forked_mid_deletion_kept_a_killed_compactions_victim_for_good(tmp_path):
    # a compaction holds its victim's file locked from the swap's commit until the file is gone;
    # a child forked meanwhile kept that lock, so after the compacting process was killed no
    # other process would delete the file (it looked "being deleted") while the child ran
    _, a, live, victim, proc = compaction_beside(tmp_path, f"""
        real_unlink = os.unlink
        def unlink(path, *args, **kwargs):  # the swap committed: fork, then stop before the file goes
            if str(path).endswith(".seg"):
                {forks_a_helper(16)}
                pause(f"{{helper}}")
            return real_unlink(path, *args, **kwargs)
        os.unlink = unlink
        b.compact()
    """)
    helper = int(said(proc))
    try:
        kill(proc)
        assert victim not in segment_records(a) and a.values.files.path_of(victim).exists()
        a.compactor.dead_limit = 1 << 40  # (only the look for what dead processes left)
        a.compact()
        assert not a.values.files.path_of(victim).exists(), "a forked child kept the victim's file"
        assert_values(a, live)
        assert a.check() == []
    finally:
        os.kill(helper, signal.SIGKILL)
        a.close()


def test_regression_a_forked_child_putting_into_its_parents_store_had_its_keys_served_the_parents_values(tmp_path):
    # the child inherited the parent's lanes and appended at the offsets the parent went on to
    # use: the child's keys then read the parent's values, as hits (LMDB's own rule: an
    # environment is not to be used after a fork)
    from tiered_kv.errors import BackendClosed

    a = opened(tmp_path / "db")
    assert a.put_many([(key(0, "p"), labelled(key(0, "p"), 1, N))]) == [True]
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: says what its puts got, and leaves at once
        try:
            said_ = f"stored {a.put_many([(key(i, 'c'), labelled(key(i, 'c'), 1, N)) for i in range(3)])}"
        except BackendClosed:
            said_ = "refused"
        except BaseException as exc:  # (anything else is a failure the parent reports)
            said_ = repr(exc)
        os.write(writer, said_.encode())
        os._exit(0)
    os.close(writer)
    os.waitpid(pid, 0)
    with os.fdopen(reader, "rb") as answer:
        assert answer.read().decode() == "refused"
    assert a.put_many([(key(i, "p"), labelled(key(i, "p"), 1, N)) for i in range(1, 4)]) == [True] * 3
    assert a.get_many([key(i, "c") for i in range(3)]) == [None] * 3
    assert a.get_many([key(i, "p") for i in range(4)]) == [labelled(key(i, "p"), 1, N) for i in range(4)]
    assert a.check() == []
    a.close()
