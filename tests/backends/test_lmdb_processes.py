"""LMDB tier across processes: a writer that exits (cleanly or by crashing) and a reader that
reopens, several processes writing one directory at once, a map grown by another process.
Real child interpreters (``sys.executable -c``) on real files."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

from storage_backends.lmdb_disk import LmdbBackend
from tests.backends import helpers

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20

PRELUDE = textwrap.dedent("""
    import os, sys
    from storage_backends.lmdb_disk import LmdbBackend

    def key(tag, i):
        return tag.encode().ljust(16, b"\\0") + i.to_bytes(16, "big")

    def value(i, n):
        return (i.to_bytes(4, "big") + bytes(3)) * (n // 7) + bytes(n % 7)
""")


def key(tag: str, i: int) -> bytes:
    return tag.encode().ljust(16, b"\0") + i.to_bytes(16, "big")


def value(i: int, n: int) -> bytes:
    return (i.to_bytes(4, "big") + bytes(3)) * (n // 7) + bytes(n % 7)


def child(body: str, *args: str) -> subprocess.Popen:
    return helpers.child(PRELUDE, body, *args)


def finish(proc: subprocess.Popen) -> str:
    return helpers.finish(proc)


def sizes(n: int) -> list[int]:
    return [1 + (i * 7919) % (300 * 1024) for i in range(n)]


def test_a_child_writes_flushes_and_exits_then_everything_reads_back(tmp_path):
    db = str(tmp_path / "db")
    out = finish(child(f"""
        b = LmdbBackend({db!r}, capacity=64 << 20)
        b.put_many([(key("w", i), value(i, n)) for i, n in enumerate({sizes(60)!r})])
        b.get_many([key("w", 7), key("w", 3)])
        b.flush()
        print(b.stats().used_bytes, b.stats().entries)
        print(b"".join(b.lru_order()).hex())
    """))
    used, entries = map(int, out.split()[:2])
    b = LmdbBackend(db, capacity=64 << 20)
    assert (b.stats().used_bytes, b.stats().entries) == (used, entries) == (sum(sizes(60)), 60)
    assert b"".join(b.lru_order()).hex() == out.split()[2]
    assert b.get_many([key("w", i) for i in range(60)]) == [value(i, n) for i, n in enumerate(sizes(60))]
    assert b.entry_meta(key("w", 7))["hits"] == 1 and b.check() == []
    b.close()


def test_a_child_that_crashes_after_its_puts_loses_nothing_it_committed(tmp_path):
    db = str(tmp_path / "db")
    finish(child(f"""
        b = LmdbBackend({db!r}, capacity=64 << 20)
        for i in range(30):
            b.put_many([(key("c", i), value(i, 100_000))])
        b.get_many([key("c", 0)])  # buffered in memory only
        os._exit(0)  # no flush, no close
    """))
    b = LmdbBackend(db, capacity=64 << 20)
    assert b.entry_meta(key("c", 0))["hits"] == 0  # the unapplied read is all that was lost
    assert b.get_many([key("c", i) for i in range(30)]) == [value(i, 100_000) for i in range(30)]
    assert b.stats().used_bytes == 30 * 100_000 and b.check() == []
    b.close()


def test_processes_writing_one_directory_at_once_keep_the_totals_right(tmp_path):
    db = str(tmp_path / "db")
    body = f"""
        tag = sys.argv[1]
        b = LmdbBackend({db!r}, capacity=4 << 20, map_size=256 << 10)  # tiny: all grow it
        for i in range(80):
            assert b.put_many([(key(tag, i), value(i, 40_000 + i))]) == [True]
            got = b.get_many([key(tag, i), key(tag, i // 2)])
            assert got[0] == value(i, 40_000 + i) and got[1] in (None, value(i // 2, 40_000 + i // 2))
            if i % 10 == 9:
                b.delete_many([key(tag, i - 5)])
        b.close()
    """
    procs = [child(body, tag) for tag in ("A", "B", "C")]
    reader = LmdbBackend(db, capacity=4 << 20)  # this process reads meanwhile
    seen = 0
    while any(p.poll() is None for p in procs):
        got = reader.get_many([key(t, i) for t in "ABC" for i in range(0, 80, 3)])
        seen += sum(v is not None for v in got)
        assert all(v is None or len(v) >= 40_000 for v in got)
    for p in procs:
        finish(p)
    stats = reader.stats()
    assert reader.check() == []
    assert stats.used_bytes <= 4 << 20 and stats.entries == len(list(reader.scan()))
    assert stats.used_bytes == sum(len(v) for v in reader.get_many(list(reader.scan())))
    reader.close()


def test_a_map_grown_by_another_process_is_adopted(tmp_path):
    db = str(tmp_path / "db")
    b = LmdbBackend(db, capacity=64 * MiB, map_size=MiB, segment_min="1GiB")  # values in the map
    b.put_many([(key("p", 0), value(0, 1000))])
    finish(child(f"""
        b = LmdbBackend({db!r}, capacity=64 << 20, segment_min="1GiB")  # the default map: far larger
        b.put_many([(key("g", i), value(i, 1 << 20)) for i in range(24)])
        b.close()
    """))
    assert b.get_many([key("g", 23), key("p", 0)]) == [value(23, MiB), value(0, 1000)]
    assert b.put_many([(key("p", 1), value(1, MiB))]) == [True]
    assert b.stats().entries == 26 and b.stats().extra["map_size"] > 24 * MiB
    assert b.check() == []
    b.close()
