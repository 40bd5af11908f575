"""Compaction keeps what a flush made durable: without ``sync`` (the default, and a tool's open)
neither the copies a compaction writes nor the LMDB commit that swaps the values' places are
synced by themselves, so the copies are fsync'd before that commit and LMDB is synced after it,
both before the victim's file is deleted. A machine crash at any moment then finds each value in
the old segment or in the new one. The order is what the test records: every ``fdatasync`` and
``unlink`` of this process, and the commits and syncs of its LMDB environment. Real LMDB
environment and segment files under tmp_path."""

from __future__ import annotations

import os

from tests.backends.test_lmdb_multiprocess_compaction import assert_values, opened, sparse
from tests.backends.test_lmdb_segments import key, segment_of


class Recorded:
    """A transaction or environment whose ``commit`` / ``sync`` go into ``events`` (the rest is
    the real one's)."""

    def __init__(self, real, events: list) -> None:
        self._real, self._events = real, events

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __enter__(self):
        return self._real.__enter__()

    def __exit__(self, *exc):
        return self._real.__exit__(*exc)

    def commit(self):
        self._events.append(("commit",))
        return self._real.commit()

    def sync(self, force: bool = False):
        self._events.append(("lmdb sync",))
        return self._real.sync(force)

    def begin(self, write: bool = False, **kwargs):
        txn = self._real.begin(write=write, **kwargs)
        return Recorded(txn, self._events) if write else txn


def test_regression_compaction_deleted_its_victim_before_the_copies_and_the_swap_were_durable(tmp_path, monkeypatch):
    # The victim's file went right after the swap's commit, neither synced: a crash before the
    # next flush lost values that flush had made durable.
    b = opened(tmp_path / "db")  # sync=False
    assert not b.sync
    live = sparse(b)
    victim = segment_of(b, key(0, "s"))
    b.flush()  # every value durable
    events: list[tuple] = []
    fdatasync, unlink = os.fdatasync, os.unlink
    monkeypatch.setattr(os, "fdatasync", lambda fd: (events.append(("fdatasync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                     fdatasync(fd))[1])
    monkeypatch.setattr(os, "unlink", lambda path, *a, **k: (events.append(("unlink", str(path))),
                                                             unlink(path, *a, **k))[1])
    env = b._db.env
    b._db.env = Recorded(env, events)
    try:
        assert b.compact() == 1
    finally:
        b._db.env = env
    copies = os.path.realpath(b.values.files.path_of(segment_of(b, key(0, "s"))))
    gone = events.index(("unlink", str(b.values.files.path_of(victim))))
    swap = max(i for i, event in enumerate(events[:gone]) if event == ("commit",))
    assert ("fdatasync", copies) in events[:swap], "the copies were not durable before the swap named them"
    assert ("lmdb sync",) in events[swap:gone], "the swap was not durable before the victim's file went"
    monkeypatch.undo()
    assert_values(b, live)
    assert b.check() == []
    b.close()

