"""Helpers of the backend scenarios: threads that fail instead of hanging, and child
interpreters that run a scenario's other process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[2]


def until(check, what: str, guard_s: float = 60.0) -> None:
    """Wait until ``check()`` is true; fail with ``what`` past ``guard_s`` (a hang guard only:
    nothing asserts how long it took)."""
    end = time.monotonic() + guard_s
    while not check():
        assert time.monotonic() < end, f"hang guard: {what}"
        time.sleep(0.01)


def run_threads(*targets, timeout: float = 20.0) -> None:
    """Run ``targets`` in daemon threads; fail (not hang) if one is still going at ``timeout``."""
    threads = [threading.Thread(target=t, daemon=True) for t in targets]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "stuck: a deadlock or a starved transaction"


def child(prelude: str, body: str, *args: str) -> subprocess.Popen:
    """A Python child running ``prelude`` then ``body`` (dedented) from the repository root."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(body), *args], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """Its standard output, once it exited successfully (its errors otherwise)."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return out


def after_listing(monkeypatch, directory: Path, meanwhile, times: int | None = 1) -> None:
    """Each listing (``os.scandir``) of ``directory`` is taken, then ``meanwhile()`` runs before
    the caller looks at any entry (the first ``times`` listings; None: every one): another
    process renaming or removing files while a walk is between its scan and its stats, every
    time instead of by chance."""
    real, left = os.scandir, [times]

    def scandir(path="."):
        entries = real(path)
        if left[0] == 0 or os.fspath(path) != os.fspath(directory):
            return entries
        left[0] = None if left[0] is None else left[0] - 1
        with entries:
            listed = list(entries)
        meanwhile()
        return iter(listed)

    monkeypatch.setattr(os, "scandir", scandir)


class Compaction(NamedTuple):
    """A store with a compaction victim, and another process about to compact it."""

    db: Path  # the store's directory
    store: object  # this process's LmdbBackend on it
    live: dict[bytes, bytes]  # the values it holds, by key
    victim: int  # the sparsest sealed segment (holding key(0, "s") alone): the one compacted
    proc: subprocess.Popen  # the compacting child


def compaction_beside(tmp_path: Path, lines: str) -> Compaction:
    """A store under ``tmp_path`` holding ``sparse``'s values, and a child interpreter
    (``test_lmdb_multiprocess_compaction``'s) that opens it as ``b``, compacting any dead bytes,
    then runs ``lines`` (dedented: where it stops, what it compacts)."""
    from tests.backends.test_lmdb_multiprocess_compaction import child

    db, store, live, victim = with_victim(tmp_path)
    proc = child(f"b = compacting({str(db)!r})\n" + textwrap.dedent(lines))
    return Compaction(db, store, live, victim, proc)


def with_victim(tmp_path: Path) -> tuple[Path, object, dict[bytes, bytes], int]:
    """(directory, store, values, victim): :func:`compaction_beside`'s store, without the child."""
    from tests.backends.test_lmdb_multiprocess_compaction import opened, sparse
    from tests.backends.test_lmdb_segments import key, segment_of

    db = tmp_path / "db"
    store = opened(db)
    live = sparse(store)
    return db, store, live, segment_of(store, key(0, "s"))
