"""A writer of the LMDB tier SIGKILLed at random instants while it fills a small disk (a tmpfs
mounted for the test, as in :mod:`tests.backends.test_lmdb_full_disk_mounted`) past what it holds,
with a capacity above the disk's size: puts of values in LMDB's pages and in segment files that
evict on the full disk, reads, ``delete_if_unchanged`` and deletes in halves. The writer journals
(fsync) the bytes each key is about to get before its put. After each kill the store opens (on a
disk left 100% full, every other time, its reserve gone too every fourth), ``check()`` finds
nothing it cannot explain, every key present reads back bytes the journal gave it (absent, never
wrong), deletes and puts work, and ``reserve.space`` comes back once there is room."""

from __future__ import annotations

import hashlib
import inspect
import os
import random
import signal
import time

from storage_backends.cas_lmdb import delete_if_unchanged
from storage_backends.lmdb_disk import LmdbBackend
from storage_backends.lmdb_diskfull import FULL_MARGIN, RESERVE_BYTES, RESERVE_NAME
from tests.backends.helpers import child
from tests.backends.test_lmdb_full_disk_mounted import small_disk  # noqa: F401
from tiered_kv.errors import BackendUnavailable

KiB, MiB = 1 << 10, 1 << 20
KILLS = 20
OPTIONS = dict(capacity=1 << 30, segment_min=64 * KiB, segment_bytes=1 * MiB)  # (the disk is 12 MiB)
SIZES = [1 * KiB, 4 * KiB, 16 * KiB, 40 * KiB, 64 * KiB, 128 * KiB, 200 * KiB]  # both sides of segment_min
# what a kill may leave that an open on a full disk had no room to tidy (its recovery is then left
# to a later look): files of segments whose commit dropped them, records of segments never written
EXPLAINED = ("orphan segment file:", "segment record without its file:")



def value(key: bytes, seed: int, n: int) -> bytes:
    """The ``n`` bytes a put of ``key`` with ``seed`` stores (the writer's, the same here)."""
    head = hashlib.sha256(key + seed.to_bytes(8, "little")).digest()
    return (head * (n // 32 + 1))[:n]


VALUE = "import hashlib\n" + inspect.getsource(value)

WRITER = """
import os, random, sys
from storage_backends.cas_lmdb import delete_if_unchanged
from storage_backends.lmdb_disk import LmdbBackend
from tiered_kv.errors import BackendUnavailable
db, journal, seed, sizes, options = sys.argv[1], sys.argv[2], int(sys.argv[3]), eval(sys.argv[4]), eval(sys.argv[5])
rng = random.Random(seed)
fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
def note(line):
    os.write(fd, (line + "\\n").encode())
    os.fsync(fd)  # (before the put: a key the store holds always has its bytes journaled)
b = LmdbBackend(db, **options)
mine, counter = {}, seed * 1_000_000  # key -> the bytes a put of this process stored
print("ready", flush=True)
while True:
    op = rng.random()
    if op < 0.6:
        items = []
        for _ in range(rng.randint(1, 6)):
            if mine and rng.random() < 0.1:
                key = rng.choice(sorted(mine))  # an overwrite
            else:
                counter += 1
                key = b"k%012d" % counter
            s, n = rng.randrange(1 << 30), rng.choice(sizes)
            note(f"{key.decode()} {s} {n}")
            items.append((key, value(key, s, n)))
        for (k, v), ok in zip(items, b.put_many(items)):
            mine[k] = v
            if not ok:
                del mine[k]
    elif op < 0.8 and mine:
        keys = rng.sample(sorted(mine), min(len(mine), 8))
        for k, got in zip(keys, b.get_many(keys)):
            if got is not None and got != mine[k]:
                sys.exit(f"wrong bytes read for {k!r}")
    elif mine:
        keys = rng.sample(sorted(mine), min(len(mine), rng.randint(1, 10)))
        try:
            if op < 0.9:
                delete_if_unchanged(b, [(k, mine[k] if rng.random() < 0.9 else b"other") for k in keys])
            else:
                b.delete_many(keys)
        except BackendUnavailable:  # (a delete of one key with no room at all)
            continue
        for k, there in zip(keys, b.contains_many(keys)):
            if not there:
                del mine[k]
"""

def journaled(journal) -> dict[bytes, list[bytes]]:
    """Every key's bytes as the journal gave them (any of them may be the one stored)."""
    found: dict[bytes, list[bytes]] = {}
    for line in journal.read_text().splitlines():
        key, s, n = line.split()
        found.setdefault(key.encode(), []).append(value(key.encode(), int(s), int(n)))
    return found


def fill_up(path) -> None:
    """Write ``path`` until the disk refuses: the disk 100% full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while True:
            try:
                os.write(fd, b"\1" * 4096)
            except OSError:
                return
    finally:
        os.close(fd)


def free_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_lmdb_writer_killed_at_any_instant_on_a_full_disk_leaves_no_wrong_bytes_and_a_store_that_writes_again(
        small_disk, tmp_path):  # noqa: F811
    db, journal, filler, reserve = small_disk / "db", tmp_path / "journal", small_disk / "filler", \
        small_disk / "db" / RESERVE_NAME
    journal.touch()
    rng = random.Random(52)
    checked = full_at_kill = stuck = 0

    def note(key: bytes, s: int, n: int) -> bytes:
        with journal.open("a") as f:
            f.write(f"{key.decode()} {s} {n}\n")
        return value(key, s, n)

    for i in range(KILLS):
        proc = child(VALUE, WRITER, str(db), str(journal), str(i + 1), repr(SIZES), repr(OPTIONS))
        assert proc.stdout.readline().strip() == "ready", proc.communicate(timeout=60)[1]
        time.sleep(rng.uniform(0, 0.8))  # (a random instant: nothing is asserted on time)
        assert proc.poll() is None, proc.communicate(timeout=60)[1]
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        full_at_kill += free_bytes(small_disk) < FULL_MARGIN
        full = i % 2 == 1
        if i % 4 == 3:
            reserve.unlink(missing_ok=True)  # (as killed after giving the reserve up)
        if full:
            fill_up(filler)
        had_reserve = reserve.exists()
        b = LmdbBackend(db, **OPTIONS)
        try:
            problems = b.check()
            assert [p for p in problems if not p.startswith(EXPLAINED)] == [], f"kill {i}: {problems}"
            keys = sorted(set(b.scan()))
            bytes_of = journaled(journal)
            for key, got in zip(keys, b.get_many(keys)):
                assert got is not None and got in bytes_of[key], f"kill {i}: wrong bytes for {key!r}"
            checked += len(keys)

            doomed = keys[: len(keys) // 2]
            half = len(doomed) // 2
            try:
                assert delete_if_unchanged(b, list(zip(doomed[:half], b.get_many(doomed[:half])))) == [True] * half
                assert b.delete_many(doomed[half:]) == len(doomed) - half
            except BackendUnavailable:  # (no room at all: a 100% full disk, no reserve, no free page)
                assert full and not had_reserve, f"kill {i}: a delete failed with room held for it"
                stuck += 1
            else:
                assert b.contains_many(doomed) == [False] * len(doomed)
                ok = [b.put_many([(k, note(k, rng.randrange(1 << 30), SIZES[t % len(SIZES)]))]) == [True]
                      for t in range(8) for k in [b"after%03d-%d" % (i, t)]]
                assert any(ok), f"kill {i} (disk {'100%' if full else 'as left'} full): no put after the deletes"

            filler.unlink(missing_ok=True)
            for t in range(8):  # (a put that finds room takes the reserve back)
                key = b"room%03d-%d" % (i, t)
                if b.put_many([(key, note(key, rng.randrange(1 << 30), 4 * KiB))]) == [True]:
                    break
            else:
                raise AssertionError(f"kill {i}: no put once the filler was gone")
            assert reserve.exists() or free_bytes(small_disk) < RESERVE_BYTES, f"kill {i}: the reserve not back"
            assert [p for p in b.check() if not p.startswith(EXPLAINED)] == []
        finally:
            b.close()
            filler.unlink(missing_ok=True)
    print(f"{KILLS} kills, {checked} keys checked, {full_at_kill} on a full disk, {stuck} with no room to delete")
    assert checked > 0 and full_at_kill > 0, (checked, full_at_kill)  # (the full disk was reached)
