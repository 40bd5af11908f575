"""The LMDB tier's consistency check beside another process that compacts: the check reads the
tables in one transaction and lists the segment files after it began, so a compaction committed
in between (values moved out of a segment whose file then goes, a new segment opened for the
copies) is no damage; what the listing and the tables disagree on is looked at again in a
transaction begun after the listing. Real damage is still reported. A compaction's victim is held
(locked) from before the commit that drains it until its file goes: neither a check's fix nor
another process's recovery deletes it as an orphan before that commit is durable.

Real child interpreters (``test_lmdb_multiprocess_compaction``'s), stopped where a scenario needs
them; real LMDB environments and segment files under tmp_path."""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from storage_backends import lmdb_segment_check
from storage_backends.lmdb_check import check_tables
from storage_backends.lmdb_disk import LmdbBackend
from storage_backends.lmdb_segment_check import check_segments
from tests.backends.helpers import compaction_beside, with_victim
from tests.backends.test_lmdb_multiprocess_compaction import (
    assert_values,
    child,
    finish,
    go_on,
    opened,
    said,
    sparse,
)
from tests.backends.test_lmdb_segments import key, segment_of, segment_records


def checked(b: LmdbBackend) -> list[str]:
    """What ``b.check()`` answers once it hands the segment check a fresh view of the tables
    (``LmdbBackend.check`` passes ``fresh=self._db.txn``): the same read transaction for both
    checks, a later one for what the file listing disagrees on."""
    with b._db.txn() as txn:
        problems, placed = check_segments(b._db.tables, txn, None, b.values.files, b._db.txn)
        return problems + check_tables(b._db.tables, txn, None, placed)


def compacting_child(db) -> subprocess.Popen:
    """Another process on ``db`` that compacts its sparsest segment once told to, says how many
    values it moved, and waits to be told to close."""
    proc = child(f"""
        b = compacting({str(db)!r})
        pause("ready")
        print(b.compact(), flush=True)
        pause("compacted")
        b.close()
    """)
    assert said(proc) == "ready"
    return proc


def test_regression_a_check_beside_a_compacting_process_took_moved_values_for_lost_and_its_new_segment_for_an_orphan(
        tmp_path, monkeypatch):
    # The check's transaction saw the values in the victim; the files were listed after the other
    # process had moved them and deleted the victim's file. It reported "value in a missing
    # segment", a stale index entry, the victim's counts, "segment record without its file", the
    # copies' new segment as an orphan, and, from the values it dropped, meta without block,
    # stale LRU entries and wrong totals: ten problems where there was none.
    db, a, live, victim = with_victim(tmp_path)
    a.close()
    tool = LmdbBackend.open_read_only(f"lmdb://{db}")
    proc = compacting_child(db)
    listing = tool.values.files.files

    def compacted_meanwhile():  # (the check's transaction has begun)
        monkeypatch.setattr(tool.values.files, "files", listing)
        go_on(proc)
        assert said(proc) == "1" and said(proc) == "compacted"
        return listing()

    monkeypatch.setattr(tool.values.files, "files", compacted_meanwhile)
    assert checked(tool) == []
    assert not tool.values.files.path_of(victim).exists(), "the other process did not compact meanwhile"
    go_on(proc)
    finish(proc)
    assert checked(tool) == [] and tool.check() == []
    assert_values(tool, live)
    tool.close()


def test_a_check_that_looks_again_still_reports_a_deleted_segment_and_an_orphan_file(tmp_path):
    db = tmp_path / "db"
    b = opened(db)
    live = sparse(b)
    lost = segment_of(b, key(5, "s"))  # holds 5, 8 and 9
    os.unlink(b.values.files.path_of(lost))
    orphan = b.values.files.path_of(0xABCDEF)
    orphan.write_bytes(b"left by nobody")
    problems = checked(b)
    assert problems == b.check(), "with nothing racing, looking again changes nothing"
    for i in (5, 8, 9):
        assert f"value in a missing segment: {key(i, 's').hex()}" in problems
    assert f"segment record without its file: {lost:016x}" in problems
    assert f"orphan segment file: {0xABCDEF:016x}" in problems
    b.check(fix=True)
    assert b.check() == [] and checked(b) == [] and not orphan.exists()
    assert_values(b, {k: v for k, v in live.items() if k not in {key(i, "s") for i in (5, 8, 9)}})
    b.close()


@pytest.mark.parametrize("looker", ["check(fix)", "recovery"])
def test_regression_a_compaction_victim_was_deleted_as_an_orphan_by_another_process_before_its_swap_was_durable(
        tmp_path, looker):
    # Between the commit that drained the victim and its file's deletion (without sync, that
    # commit is not durable yet), another process's check(fix) or recovery (every 30 s) took the
    # file for an orphan and deleted it: a machine crash then would undo the swap and leave the
    # values in a file that is gone.
    _, a, live, victim, proc = compaction_beside(tmp_path, """
        real_unlink = os.unlink
        def unlink(path, *args, **kwargs):  # the swap committed: stop before the victim's file goes
            if str(path).endswith(".seg"):
                os.unlink = real_unlink
                pause("deleting")
            return real_unlink(path, *args, **kwargs)
        os.unlink = unlink
        b.compact()
        b.close()
    """)
    assert said(proc) == "deleting"
    assert victim not in segment_records(a)  # drained: its record went with the swap
    if looker == "check(fix)":
        assert a.check(fix=True) == [], "a file being deleted is no orphan"
    else:
        a.compactor.dead_limit = 1 << 40  # (only the look for what dead processes left)
        a.compact()
    assert a.values.files.path_of(victim).exists(), "deleted before the swap was durable"
    go_on(proc)
    finish(proc)
    assert not a.values.files.path_of(victim).exists()
    assert_values(a, live)
    assert a.check() == []
    a.close()


@pytest.mark.parametrize("fix", [False, True])
def test_a_check_while_a_compaction_deletes_its_victim_does_not_report_the_file_it_saw_go_as_an_orphan(
        tmp_path, monkeypatch, fix):
    # The check found the victim's file there, then asked whether someone held it for deletion:
    # the compaction had deleted it (and let its lock go) in between, the lock could no longer
    # be tried, and the file that was gone was reported as an orphan (with fix: "repaired").
    _, a, live, victim = with_victim(tmp_path)
    deleting, go = threading.Event(), threading.Event()
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):  # the swap committed: wait before the victim's file goes
        if str(path) == str(a.values.files.path_of(victim)):
            deleting.set()
            assert go.wait(60)
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    compaction = threading.Thread(target=a.compact, daemon=True)
    compaction.start()
    assert deleting.wait(60)
    real_being_deleted = lmdb_segment_check.being_deleted

    def deleted_meanwhile(path):  # the check asks: the compaction deletes the file first
        if str(path) == str(a.values.files.path_of(victim)) and not go.is_set():
            go.set()
            compaction.join(60)
        return real_being_deleted(path)

    monkeypatch.setattr(lmdb_segment_check, "being_deleted", deleted_meanwhile)
    assert a.check(fix=fix) == []
    assert go.is_set() and not compaction.is_alive(), "the check did not look at the victim's file"
    assert not a.values.files.path_of(victim).exists()
    assert_values(a, live)
    assert a.check() == []
    a.close()


@pytest.mark.parametrize("fix", [False, True])
def test_a_check_beside_a_delete_that_drained_a_segment_does_not_report_its_file_as_an_orphan(
        tmp_path, monkeypatch, fix):
    # A delete (or an eviction, a seal) that empties a sealed segment drops its record and deletes
    # its file after the commit; a check between the two (in any process) found a file no record
    # names, not held for deletion: "orphan segment file" (125 in 2,700 checks of a soak).
    _, a, live, victim = with_victim(tmp_path)
    deleting, go = threading.Event(), threading.Event()
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):  # the drain committed: wait before the file goes
        if threading.current_thread() is delete and str(path) == str(a.values.files.path_of(victim)):
            deleting.set()
            assert go.wait(60)
        return real_unlink(path, *args, **kwargs)

    delete = threading.Thread(target=a.delete_many, args=([key(0, "s")],), daemon=True)
    monkeypatch.setattr(os, "unlink", unlink)
    delete.start()
    try:
        assert deleting.wait(60)
        assert a.check(fix=fix) == []
    finally:
        go.set()
        delete.join(60)
    assert not a.values.files.path_of(victim).exists()
    assert_values(a, {k: v for k, v in live.items() if k != key(0, "s")})
    assert a.check() == []
    a.close()
