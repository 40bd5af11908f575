"""The LMDB tier's segment files with several processes on one directory and compaction running:
a process killed with its segments open, or mid-compaction (after its copies were written, inside
the transaction swapping their places, between the commit that drained a segment and its file's
deletion) while another runs on; two processes compacting the same segment at once; a reader in
one process mid-visit while another's compaction drops the segment it reads; a writer whose
process the others cannot look up; a process short of descriptors looking at the others' segments
and compacting; a map another process grew. Real child interpreters, stopped where a scenario needs them (they
say so on their standard output and wait for a line on their standard input) and killed with
SIGKILL; real LMDB environments and segment files under tmp_path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from storage_backends.lmdb_disk import LmdbBackend
from tests.backends.helpers import compaction_beside
from tests.backends.test_lmdb_segments import KiB, MiB, identify, key, labelled, segment_of, segment_records

REPO = Path(__file__).resolve().parents[2]
N = 200 * KiB  # five values per 1 MiB segment

PRELUDE = textwrap.dedent("""
    import os, resource, sys, time
    from storage_backends.lmdb_disk import LmdbBackend
    from storage_backends.segment_owners import owner_alive
    from tests.backends.test_lmdb_segments import KiB, MiB, identify, key, labelled, segment_records
    from tests.backends.test_lmdb_multiprocess_compaction import N, sparse

    def pause(what):  # say where this process is, then wait for a line (or to be killed)
        print(what, flush=True)
        sys.stdin.readline()

    def compacting(path):  # a store whose compactor moves any dead bytes
        b = LmdbBackend(path, capacity=64 * MiB, segment_bytes=MiB)
        b.compactor.dead_limit = 0
        return b

    def short_of_descriptors():  # every descriptor taken but a few: (held, soft, hard limit)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        held = []
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            return held, soft, hard
""")


def child(body: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], cwd=REPO, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def said(proc: subprocess.Popen, timeout: float = 120.0) -> str:
    """The child's next line (it stopped where it says); fails (not hangs) when none comes."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not lines or not lines[0]:
        proc.kill()
        pytest.fail(f"the child said nothing: {proc.communicate(timeout=60)[1]}")
    return lines[0].strip()


def go_on(proc: subprocess.Popen) -> None:
    proc.stdin.write("\n")
    proc.stdin.flush()


def finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return out


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)


def opened(db: Path) -> LmdbBackend:
    return LmdbBackend(db, capacity=64 * MiB, segment_bytes=MiB)


def sparse(b: LmdbBackend, tag: str = "s") -> dict[bytes, bytes]:
    """Eleven values put and six deleted: a sealed segment holding one value (the sparsest), a
    sealed one holding three, and the open one; compaction on from the next check. The values
    left, by key."""
    for i in range(11):
        assert b.put_many([(key(i, tag), labelled(key(i, tag), 1, N))]) == [True]
    assert b.delete_many([key(i, tag) for i in (1, 2, 3, 4, 6, 7)]) == 6
    b.compactor.dead_limit = 0
    return {key(i, tag): labelled(key(i, tag), 1, N) for i in (0, 5, 8, 9, 10)}


def assert_values(b: LmdbBackend, expected: dict[bytes, bytes]) -> None:
    got = b.get_many(list(expected))
    assert [identify(v) if v is not None else None for v in got] == [identify(v) for v in expected.values()]


def leftovers(b: LmdbBackend) -> dict[str, object]:
    """What other processes left: segments still open that are not this process's, and segment
    files no record names."""
    records = segment_records(b)
    return {"open": sorted(s for s, r in records.items() if not r.sealed and r.owner_pid != os.getpid()),
            "orphans": sorted(set(b.values.files.files()) - set(records))}


# -- a process killed while another runs on ----------------------------------------------------------
def test_regression_a_killed_writers_open_segment_stayed_on_disk_while_another_process_ran_on(tmp_path):
    # Only a writer's open sealed the segments of processes that died: an engine running on
    # beside a killed tool (or a replica that is not restarted) kept their files, and the dead
    # bytes in them, for as long as it ran (up to segment_bytes per lane of the dead process).
    db = tmp_path / "db"
    a = opened(db)  # runs before, during and after the other
    proc = child(f"""
        b = LmdbBackend({str(db)!r}, capacity=64 * MiB, segment_bytes=MiB)
        for i in range(4):
            assert b.put_many([(key(i, "b"), labelled(key(i, "b"), 1, N))]) == [True]
        pause(*b.values.files.open_segments())
    """)
    segment = int(said(proc))
    kill(proc)
    theirs = {key(i, "b"): labelled(key(i, "b"), 1, N) for i in range(4)}
    assert_values(a, theirs)
    assert leftovers(a)["open"] == [segment]

    a.compact()  # (a put's compaction check does the same, at most once a second)
    record = segment_records(a)[segment]
    assert record.sealed and record.owner_pid == 0, "a dead process's open segment stayed open"
    assert_values(a, theirs)
    assert a.delete_many(list(theirs)) == 4
    assert not a.values.files.path_of(segment).exists(), "a dead process's drained segment kept its file"
    assert leftovers(a) == {"open": [], "orphans": []} and a.check() == []
    a.close()


def test_regression_a_segment_file_left_by_a_process_killed_before_deleting_it_stayed_for_good(tmp_path):
    # A segment's file is deleted after the commit that drained it: a process killed between the
    # two left the file, and only a writer's open deleted it (check() meanwhile said "orphan").
    db = tmp_path / "db"
    a = opened(db)
    proc = child(f"""
        b = LmdbBackend({str(db)!r}, capacity=64 * MiB, segment_bytes=MiB)
        for i in range(6):  # the sixth opens a second segment: the first is sealed
            assert b.put_many([(key(i, "b"), labelled(key(i, "b"), 1, N))]) == [True]
        b._db.on_drained = lambda segments: pause(*segments)  # (committed: its file goes now)
        b.delete_many([key(i, "b") for i in range(5)])
    """)
    drained = int(said(proc))
    kill(proc)
    path = a.values.files.path_of(drained)
    assert path.exists() and drained not in segment_records(a)
    assert a.check() == [f"orphan segment file: {drained:016x}"]

    a.compact()
    assert not path.exists(), "an orphan segment file stayed while this process ran"
    assert leftovers(a) == {"open": [], "orphans": []} and a.check() == []
    assert_values(a, {key(5, "b"): labelled(key(5, "b"), 1, N)})
    a.close()


STOPS = {  # where a compacting process is killed
    "copies written": """
        write = b.values.write
        b.values.write = lambda values: (write(values), pause("copied"))[0]
    """,
    "inside the swap": """
        b.compactor._swap = lambda *args: pause("swapping")  # (holding LMDB's write lock)
    """,
    "before the victim's file goes": """
        b._db.on_drained = lambda segments: pause("drained")
    """,
}


@pytest.mark.parametrize("stop", list(STOPS))
def test_a_process_killed_mid_compaction_loses_nothing_and_the_other_clears_what_it_left(tmp_path, stop):
    db, a, live, victim, proc = compaction_beside(tmp_path, textwrap.dedent(STOPS[stop]) + "b.compact()\n")
    said(proc)
    kill(proc)
    assert_values(a, live)  # whatever the other did before it died

    a.compact()  # seals what it left, deletes its orphan; compacts on
    while a.compact():
        pass
    assert leftovers(a) == {"open": [], "orphans": []}
    assert not a.values.files.path_of(victim).exists()
    assert_values(a, live)
    assert a.check() == []
    a.close()
    again = opened(db)
    assert_values(again, live)
    assert again.check() == []
    again.close()


# -- two compactions at once -------------------------------------------------------------------------
def test_two_processes_compacting_one_segment_at_once_move_each_value_once_and_lose_none(tmp_path):
    db, a, live, victim, proc = compaction_beside(tmp_path, """
        write = b.values.write
        b.values.write = lambda values: (write(values), pause("copied"))[0]  # then the other compacts
        print(b.compact(), flush=True)
        b.values.write = write
        b.close()
    """)
    assert said(proc) == "copied"
    assert a.compact() == 1  # the same victim: its one value
    assert not a.values.files.path_of(victim).exists()
    go_on(proc)
    assert finish(proc).split() == ["0"], "the other's copy took the place of a value moved meanwhile"
    assert segment_of(a, key(0, "s")) in a.values.files.open_segments()
    assert_values(a, live)
    assert leftovers(a) == {"open": [], "orphans": []}, "the other's copy was not dead bytes it sealed and dropped"
    assert a.check() == []
    a.close()


# -- a reader mid-visit ------------------------------------------------------------------------------
def test_a_visit_in_one_process_reads_a_segment_another_process_compacted_away_or_misses_never_other_bytes(
        tmp_path):
    db = tmp_path / "db"
    finish(child(f"""
        b = LmdbBackend({str(db)!r}, capacity=64 * MiB, segment_bytes=MiB)
        sparse(b)
        b.close()
    """))
    a = opened(db)  # (a reader: no descriptor of a segment open before it reads from it)
    live = {key(i, "s"): labelled(key(i, "s"), 1, N) for i in (0, 5, 8, 9, 10)}
    first, second = key(0, "s"), key(5, "s")  # alone in the sparsest segment; in the other sealed one
    segments = {segment_of(a, first), segment_of(a, second)}
    proc = child(f"""
        b = compacting({str(db)!r})
        pause("ready")
        print(b.compact() + b.compact(), flush=True)
        b.close()
    """)
    assert said(proc) == "ready"
    got = {}

    def visitor(sizes, reader):
        head = bytearray(100)
        assert reader.read(0, 0, head) is True  # the first value's segment: read from
        go_on(proc)
        got["moved"] = finish(proc).split()  # both segments compacted away meanwhile
        got["gone"] = sorted(s for s in segments if a.values.files.path_of(s).exists())
        whole = bytearray(sizes[0])
        got["read from"] = (reader.read(0, 0, whole), identify(whole))
        got["never read from"] = reader.read(1, 0, bytearray(sizes[1]))

    assert a.visit_ranges([first, second], visitor) == [True, True]
    assert got == {"moved": ["4"], "gone": [], "read from": (True, (first, 1)), "never read from": None}
    assert (a.stats().gets, a.stats().hits) == (2, 1), "the value the visit missed was counted a hit"
    assert_values(a, live)  # where the other moved them
    assert not segments & set(segment_records(a)) and a.check() == []
    a.close()


# -- telling whether the other processes run ----------------------------------------------------------
def test_regression_a_live_writer_the_others_could_not_look_up_had_its_open_segment_sealed_under_it(tmp_path):
    # A writer of this pid namespace was taken for dead whenever its pid did not name it as its
    # record does (a /proc mounted with hidepid hides other users' processes): a writer's open
    # then sealed the segment it still appended to, which could drain and lose its file under it.
    # The lock it holds on the file says it runs.
    db = tmp_path / "db"
    proc = child(f"""
        b = LmdbBackend({str(db)!r}, capacity=64 * MiB, segment_bytes=MiB)
        b.values.files.start += 1  # its records name a start time /proc does not show for it
        assert b.put_many([(key(0, "b"), labelled(key(0, "b"), 1, N))]) == [True]
        pause(*b.values.files.open_segments())
        assert b.put_many([(key(1, "b"), labelled(key(1, "b"), 1, N))]) == [True]
        pause("put")
    """)
    segment = int(said(proc))
    a = opened(db)
    try:
        a.compact()
        assert not segment_records(a)[segment].sealed, "the segment a live writer appends to was sealed"
        assert a.delete_many([key(0, "b")]) == 1
        go_on(proc)
        assert said(proc) == "put"
        assert a.values.files.path_of(segment).exists()
        assert_values(a, {key(1, "b"): labelled(key(1, "b"), 1, N)})
    finally:
        kill(proc)
    a.compact()  # gone now: its lock is free
    assert segment_records(a)[segment].sealed and a.check() == []
    a.close()


def test_a_process_short_of_descriptors_takes_no_other_writer_for_dead(tmp_path):
    db = tmp_path / "db"
    a = opened(db)
    assert a.put_many([(key(0), labelled(key(0), 1, N))]) == [True]
    (segment,) = a.values.files.open_segments()
    proc = child(f"""
        b = compacting({str(db)!r})
        record = segment_records(b)[{segment}]
        held, soft, hard = short_of_descriptors()
        print(owner_alive(record, b.values.files.path_of({segment})), b.compact(), flush=True)
    """)
    assert finish(proc).split() == ["True", "0"]
    assert not segment_records(a)[segment].sealed, "a process short of descriptors sealed a live writer's segment"
    assert a.put_many([(key(1), labelled(key(1), 1, N))]) == [True]
    assert segment_of(a, key(1)) == segment and a.check() == []
    a.close()


# -- a process short of descriptors -------------------------------------------------------------
def test_regression_a_segment_compaction_could_not_read_for_want_of_descriptors_was_never_compacted_again(tmp_path):
    # A victim none of whose values could be read was passed over for good (meant for damage):
    # one read while the process was short of descriptors kept its dead bytes as long as the
    # process ran, however many descriptors it had again.
    db = tmp_path / "db"
    finish(child(f"""
        b = LmdbBackend({str(db)!r}, capacity=64 * MiB, segment_bytes=MiB)
        sparse(b)
        b.close()
    """))
    out = finish(child(f"""
        b = compacting({str(db)!r})
        held, soft, hard = short_of_descriptors()
        short = b.compact()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        print(short, b.compact(), b.compact(), b.compact(), flush=True)
        b.close()
    """))
    assert out.split() == ["0", "1", "3", "0"], "the sparsest segment's one value never moved"
    b = opened(db)
    assert_values(b, {key(i, "s"): labelled(key(i, "s"), 1, N) for i in (0, 5, 8, 9, 10)})
    assert b.check() == []
    b.close()


# -- a map another process grew -------------------------------------------------------------------
def test_regression_stats_failed_after_another_process_grew_the_map(tmp_path):
    # stats() read the totals inside the shared remap gate: when another process had grown the
    # map meanwhile, its transaction could not adopt the new size (that waits for the gate) and
    # it raised BackendUnavailable ("cannot adopt the resized map") instead of the figures.
    db = tmp_path / "db"
    a = LmdbBackend(db, capacity=64 * MiB, map_size=MiB, segment_min="1GiB")  # values in the map
    assert a.put_many([(key(0), labelled(key(0), 1, 1000))]) == [True]
    finish(child(f"""
        b = LmdbBackend({str(db)!r}, capacity=64 * MiB, segment_min="1GiB")  # a far larger map
        assert b.put_many([(key(i, "g"), labelled(key(i, "g"), 1, MiB)) for i in range(24)]) == [True] * 24
        b.close()
    """))
    stats = a.stats()
    assert stats.entries == 25 and stats.extra["map_size"] > 24 * MiB
    assert a.check() == []
    a.close()
