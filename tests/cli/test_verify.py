"""`verify` finds flipped bytes, blocks under the wrong key, foreign entries and bookkeeping
drift; `--fix` removes / repairs them and says so; a clean store verifies with exit 0."""

from __future__ import annotations

import os

import lmdb

from storage_backends.file_dir import FileBackend
from storage_backends.file_entries import remove, target_of
from storage_backends.file_layout import file_of, temp_of
from storage_backends.lmdb_disk import LmdbBackend
from tests.backends.helpers import after_listing
from tests.cli.conftest import cli
from tiered_kv.store.records import is_block_key


def _edit(path, fn) -> bytes:
    """Apply ``fn(backend, block_keys)`` to the store at ``path``; returns what it returns."""
    b = LmdbBackend(path, capacity="1GiB")
    try:
        return fn(b, sorted(k for k in b.scan() if is_block_key(k)))
    finally:
        b.close()


def flip_one(b, keys) -> bytes:
    key = keys[len(keys) // 2]
    [value] = b.get_many([key])
    blob = bytearray(value)
    blob[len(blob) - 100] ^= 0x40  # a byte in the body
    b.put_many([(key, bytes(blob))])
    return key


def test_flipped_bytes_fail_verify_naming_the_key_fix_removes_it_then_verify_passes(demo_copy):
    url = f"lmdb://{demo_copy}"
    assert cli("verify", url).code == 0
    key = _edit(demo_copy, flip_one)
    found = cli("verify", url)
    assert found.code == 1 and key.hex() in found.out
    report = cli("verify", url, "--json").json()
    assert report["ok"] is False
    [finding] = report["tiers"][0]["findings"]
    assert (finding["kind"], finding["key"], finding["fixed"]) == ("corrupt", key.hex(), False)
    assert "checksum" in finding["detail"]
    fixed = cli("verify", url, "--fix", "--json").json()
    assert fixed["ok"] is True and fixed["tiers"][0]["findings"][0]["fixed"] is True
    assert fixed["tiers"][0]["actions"] == ["removed 1 of 1 entries (1 corrupt)"]
    assert _edit(demo_copy, lambda b, keys: b.contains_many([key])) == [False]
    again = cli("verify", url)
    assert again.code == 0 and "no problems" in again.out


def test_misplaced_blocks_foreign_keys_and_meta_drift_are_found_and_fixed(demo_copy):
    url = f"lmdb://{demo_copy}"

    def damage(b, keys):
        [value] = b.get_many([keys[0]])
        b.put_many([(keys[1], value),  # a valid block under another block's key
                    (b"someone else's key", b"x" * 10)])
        return keys[1]

    moved = _edit(demo_copy, damage)
    env = lmdb.open(str(demo_copy), max_dbs=8)  # drop one meta row behind the backend's back
    with env.begin(write=True) as txn:
        meta = env.open_db(b"meta", txn=txn)
        victim = sorted(k for k, _ in txn.cursor(db=meta) if len(k) == 32)[-1]
        txn.delete(victim, db=meta)
    env.close()
    report = cli("verify", url, "--json").json()["tiers"][0]
    kinds = {(f["kind"], f["key"]) for f in report["findings"]}
    assert ("mismatched", moved.hex()) in kinds
    assert ("orphaned", b"someone else's key".hex()) in kinds
    assert any(f["kind"] == "meta_drift" and victim.hex() in f["detail"] for f in report["findings"])
    assert report["problems"]["mismatched"] == 1 and report["problems"]["orphaned"] == 1
    fixed = cli("verify", url, "--fix")
    assert fixed.code == 0 and "fix: removed 2 of 2 entries" in fixed.out and "fix: repaired" in fixed.out
    assert cli("verify", url).code == 0


def test_verify_on_a_file_store_reports_leftover_temporary_files(demo_store, tmp_path, monkeypatch):
    from storage_backends import file_entries

    dest = f"file://{tmp_path / 'export'}"
    assert cli("copy", demo_store.url, dest).code == 0
    sub = next(p for p in (tmp_path / "export").iterdir() if p.is_dir())
    leftover = sub / ".deadbeef.1.2.3.tmp"
    leftover.write_bytes(b"half a block")
    # a temporary file's age is its change time (a tombstone keeps its value's old mtime), which
    # no call sets back: every temporary file counts as old here
    monkeypatch.setattr(file_entries, "STALE_S", 0.0)
    found = cli("verify", dest, "--json").json()["tiers"][0]
    assert [f["kind"] for f in found["findings"]] == ["meta_drift"]
    assert cli("verify", dest, "--fix").code == 0 and not leftover.exists()
    assert cli("verify", dest).code == 0


def test_regression_verify_of_a_live_file_store_exited_2_on_a_file_renamed_mid_walk(tmp_path, monkeypatch):
    """Another process puts and deletes: between each listing of a directory and verify's look
    at its files, the key it stored last goes and the put it had half-way renames its temporary
    link over the key's name (``No such file or directory (…/2a/.….link.tmp)``: exit 2)."""
    root = tmp_path / "fs"
    FileBackend(root).close()
    names = (file_of(root, i.to_bytes(15, "big") + b"\x2a") for i in range(1, 1000))
    done, half_way, moves = [], [], []

    def start_a_put():
        name = next(names)
        name.parent.mkdir(exist_ok=True)
        target_of(name, b"tenant-a").write_bytes(b"a value")
        link = temp_of(name, "link")
        os.symlink(target_of(name, b"tenant-a").name, link)
        half_way.append((link, name))

    def the_writer_goes_on():
        for name in done:
            remove(name)
        link, name = half_way.pop()
        os.replace(link, name)
        done[:] = [name]
        start_a_put()
        moves.append(name)

    start_a_put()
    after_listing(monkeypatch, root / "2a", the_writer_goes_on, times=None)
    for args in (["verify", f"file://{root}"], ["verify", f"file://{root}", "--fix"]):
        result = cli(*args)
        assert (result.code, result.err) == (0, ""), args
    assert len(moves) >= 4  # each run's listing of the keys and its check met the writer


def test_regression_verify_reported_drift_on_every_entry_of_a_healthy_format_1_store(demo_store, tmp_path):
    """A store the version before tenants wrote, verified read-only, was said to miss a tenant
    LRU entry per key and its tenant totals (exit 1): those tables come with its first write."""
    from storage_backends.lmdb_tables import FORMAT
    from tests.backends.test_lmdb_failure_paths import stored_format
    from tests.backends.test_lmdb_tenants import write_format_1

    demo = LmdbBackend.open_read_only(demo_store.url)
    keys = sorted(demo.scan())
    values = [bytes(v) for v in demo.get_many(keys)]
    demo.close()
    write_format_1(tmp_path / "old", [(k, v, 10**9 * i) for i, (k, v) in enumerate(zip(keys, values))])
    url = f"lmdb://{tmp_path / 'old'}"
    result = cli("verify", url, "--json")
    assert result.code == 0, result.out
    [tier] = result.json()["tiers"]
    assert tier["findings"] == [] and tier["valid_blocks"] == len(keys) - 1
    assert tier["notes"] == ["format 1: upgraded by the first write; tenant bookkeeping not checked"]
    assert stored_format(tmp_path / "old") == 1  # verify wrote nothing
    fixed = cli("verify", url, "--fix", "--json")
    assert fixed.code == 0 and fixed.json()["tiers"][0]["notes"] == [], fixed.out
    assert stored_format(tmp_path / "old") == FORMAT  # --fix writes: upgraded, then checked whole
    again = cli("verify", url)
    assert again.code == 0 and "note" not in again.out, again.out
