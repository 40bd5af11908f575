"""What a clean close of the LMDB tier leaves on the disk. Its contract: once ``close`` returns,
what was stored is durable, as after a ``flush``: the segment values this process wrote are
fsync'd, and only then the index that names them (else a power loss after a clean close could
keep an index naming segment bytes that never reached the disk: blocks the user believed saved,
lost). A segment whose fsync fails at close has its entries withdrawn before the index's sync. A
process that wrote nothing fsyncs nothing.

Real LMDB environments and segment files under tmp_path. Which file is fsync'd when is seen either
at ``os.fdatasync`` (the real call, recorded) or, for the order of the segments' and LMDB's own
fsyncs (LMDB calls ``fdatasync`` from C), by tracing a child process's system calls with strace
(skipped where strace cannot trace)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from storage_backends.lmdb_segments import SUFFIX
from storage_backends.registry import open_backend
from tests.backends.helpers import REPO
from tests.backends.test_lmdb_segment_fsync import WritebackFailsOnce, blob, key, place_of, segment_of

MiB = 1 << 20
OPEN = "from storage_backends.registry import open_backend\nfrom storage_backends.lmdb_disk import LmdbBackend\n"


def lmdb_tier(path):
    return open_backend(f"lmdb://{path}?capacity=256MiB&segment_bytes=16MiB")


class Fsyncs:
    """``os.fdatasync``, recording the segments it fsyncs (then the real call)."""

    def __init__(self, monkeypatch) -> None:
        self.real, self.segments = os.fdatasync, []
        monkeypatch.setattr(os, "fdatasync", self)

    def __call__(self, fd: int) -> None:
        segment = segment_of(fd)
        if segment is not None:
            self.segments.append(segment)
        return self.real(fd)


def traced_fsyncs(tmp_path, body: str) -> list[str]:
    """The files a Python child running ``body`` fsyncs, in order (``fsync``/``fdatasync``, as
    strace names their descriptors); the test is skipped where strace cannot trace a child."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    trace = tmp_path / "trace.txt"
    command = ["strace", "-f", "-qq", "-y", "-e", "trace=fsync,fdatasync", "-o", str(trace),
               sys.executable, "-c", OPEN + textwrap.dedent(body)]
    done = subprocess.run(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0 and "ptrace" in done.stderr:
        pytest.skip(f"strace cannot trace here: {done.stderr.strip()[:200]}")
    assert done.returncode == 0, done.stderr
    return re.findall(r"fd(?:ata)?sync\(\d+<([^>]*)>\) = 0", trace.read_text())


def test_regression_a_clean_close_left_the_segment_values_it_stored_unsynced(tmp_path, monkeypatch):
    """Puts without sync and no flush, then close: the segment files were never fsync'd (only
    LMDB's index was), so a power loss after the clean close lost values the index still named."""
    b = lmdb_tier(tmp_path / "db")
    assert b.put_many([(key(i), blob(i)) for i in range(3)]) == [True] * 3
    segments = {place_of(b, key(i)).segment for i in range(3)}
    fsyncs = Fsyncs(monkeypatch)
    b.close()
    assert segments <= set(fsyncs.segments), "a segment holding stored values was not fsync'd by close"
    monkeypatch.undo()
    with lmdb_tier(tmp_path / "db") as again:
        assert again.get_many([key(i) for i in range(3)]) == [blob(i) for i in range(3)]


def test_regression_a_segment_whose_fsync_failed_at_close_stayed_named_by_the_index(tmp_path, monkeypatch):
    """The fsync of a segment fails (EIO) at close: its entries are withdrawn before the index is
    synced, so the index never names bytes that may not be on the disk; a value in LMDB's own
    pages stays, and the store opens clean."""
    b = lmdb_tier(tmp_path / "db")
    small = (b"small".ljust(32, b"\0"), b"kept in lmdb's pages")
    assert b.put_many([(key(1), blob(1)), small]) == [True, True]
    segment = place_of(b, key(1)).segment
    disk = WritebackFailsOnce(monkeypatch)
    b.close()  # (logged, never raised)
    assert disk.failed == [segment]
    monkeypatch.undo()
    with lmdb_tier(tmp_path / "db") as again:
        assert again.get_many([key(1), small[0]]) == [None, small[1]]
        assert again.check() == []


def test_a_clean_close_syncs_the_segment_values_before_the_index_that_names_them(tmp_path):
    """The order on the disk: every segment file this process wrote is fsync'd before LMDB's data
    file, whose sync makes the index naming them durable."""
    fsyncs = traced_fsyncs(tmp_path, f"""
        b = open_backend("lmdb://{tmp_path}/db?capacity=256MiB&segment_bytes=16MiB")
        assert b.put_many([(bytes([i]) * 32, bytes([i]) * {MiB}) for i in range(3)]) == [True] * 3
        b.close()
    """)
    segments = [i for i, name in enumerate(fsyncs) if name.endswith(SUFFIX)]
    index = [i for i, name in enumerate(fsyncs) if name.endswith("data.mdb")]
    assert segments, f"no segment file fsync'd by close: {fsyncs}"
    assert index and max(segments) < index[-1], f"the index was synced before the segment values: {fsyncs}"


def test_regression_a_readers_close_fsynced_an_index_it_never_wrote(tmp_path):
    """A tool's read-only open that only read paid an fsync of LMDB's data file at close (and must
    pay none of the segments either)."""
    with lmdb_tier(tmp_path / "db") as b:
        assert b.put_many([(key(i), blob(i)) for i in range(2)]) == [True] * 2
    fsyncs = traced_fsyncs(tmp_path, f"""
        b = LmdbBackend.open_read_only("lmdb://{tmp_path}/db")
        assert all(v is not None for v in b.get_many([{key(0)!r}, {key(1)!r}]))
        b.close()
    """)
    assert fsyncs == []


def test_a_close_after_the_store_directory_was_removed_does_not_raise(tmp_path):
    """The directory (segments and all) removed behind the writer's back: close still ends quietly,
    as it did before it fsync'd anything."""
    b = lmdb_tier(tmp_path / "db")
    assert b.put_many([(key(i), blob(i)) for i in range(2)]) == [True] * 2
    shutil.rmtree(tmp_path / "db")
    b.close()
    b.close()  # (idempotent)


class SyncFailsOnce:
    """An environment (the real one behind it) whose next ``sync`` fails as a full or dying disk
    makes it fail; the syncs that reached it are counted."""

    def __init__(self, env) -> None:
        self.env, self.failing, self.synced = env, True, 0

    def __getattr__(self, name: str):
        return getattr(self.env, name)

    def sync(self, force: bool = False) -> None:
        if self.failing:
            self.failing = False
            raise OSError(5, "Input/output error")
        self.synced += 1
        self.env.sync(force)


def test_regression_a_failed_sync_let_the_next_clean_close_skip_the_index_sync(tmp_path):
    tier = lmdb_tier(tmp_path / "db")
    assert tier.put_many([(key(1), blob(1, 4096))]) == [True]
    env = tier._db.env = SyncFailsOnce(tier._db.env)
    with pytest.raises(OSError):
        tier._db.sync()  # nothing was made durable: the commits are still to sync
    tier.close()
    assert env.synced == 1, "the close took the failed sync for a done one"
