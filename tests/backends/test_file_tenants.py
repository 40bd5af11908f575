"""Tenants in the file medium: a tenant's value lives in a file named for its key and tenant, and
the key's own name links to it, so reads never need the tenant and a listing finds it after a
restart; values of stores written before tenants read as no tenant's. Real files under tmp_path."""

from __future__ import annotations

import json
import os
import time

from storage_backends.file_dir import FileBackend
from storage_backends.file_entries import STALE_S
from storage_backends.file_layout import MARKER, file_of

KiB = 1 << 10
UNIT = 100 * KiB
A, B = b"tenant-a", b"tenant-b"


def key(tenant: bytes, i: int) -> bytes:
    return tenant[-1:] * 16 + i.to_bytes(16, "big")


def totals(b: FileBackend) -> dict[bytes, tuple[int, int]]:
    return {tenant: tuple(t) for tenant, t in b.tenant_totals().items()}


def files_in(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())


def test_tenants_usage_and_quota_order_survive_a_restart(tmp_path):
    root = tmp_path / "files"
    with FileBackend(root, tenant_quota=3 * UNIT) as b:
        for i in (1, 2, 3):
            assert b.put_many([(key(A, i), bytes([i]) * UNIT)], tenant=A) == [True]
        b.put_many([(key(B, 1), bytes(UNIT))], tenant=B)
    now = time.time_ns()
    for age, i in ((10, 1), (30, 2), (20, 3)):  # A's 2 is its least recently used, not its first
        os.utime(file_of(root, key(A, i)), ns=(now - age * 10**9, now - 60 * 10**9))
    with FileBackend(root, tenant_quota=3 * UNIT) as b:
        assert totals(b) == {A: (3 * UNIT, 3), B: (UNIT, 1)}
        assert b.entry_meta(key(A, 1))["tenant"] == A and b.entry_meta(key(B, 1))["tenant"] == B
        assert b.get_many([key(A, 3)]) == [bytes([3]) * UNIT]
        assert b.put_many([(key(A, 4), bytes(UNIT))], tenant=A) == [True]
        assert b.contains_many([key(A, i) for i in (1, 2, 3, 4)]) == [True, False, True, True]
        assert b.stats().extra["quota_evictions"] == 1 and b.check() == []


def test_a_store_written_before_tenants_reads_as_no_tenants_and_takes_new_ones(tmp_path):
    root = tmp_path / "old"
    root.mkdir()
    (root / MARKER).write_text(json.dumps({"format": 1}))
    old = {bytes([i]) * 32: bytes([i]) * (10 + i) for i in range(4)}
    for k, v in old.items():
        path = file_of(root, k)
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(v)
    with FileBackend(root, create=False) as b:
        assert b.get_many(list(old)) == list(old.values())
        assert totals(b) == {b"": (sum(map(len, old.values())), 4)}
        assert json.loads((root / MARKER).read_text())["format"] == 1  # nothing written yet
        assert b.put_many([(key(A, 1), b"new")], tenant=A) == [True]
        assert json.loads((root / MARKER).read_text())["format"] == 2
        assert totals(b)[A] == (3, 1) and b.check() == []


def test_an_overwrite_by_another_tenant_moves_the_value_and_leaves_no_file_behind(tmp_path):
    root = tmp_path / "files"
    k = key(A, 1)
    with FileBackend(root) as b:
        for tenant, value in ((A, b"a" * 10), (A, b"A" * 11), (B, b"b" * 12), (b"", b"-" * 13), (A, b"a" * 14)):
            assert b.put_many([(k, value)], tenant=tenant) == [True]
            assert b.get_many([k]) == [value] and b.contains_many([k]) == [True]
            assert totals(b) == {tenant: (len(value), 1)} and b.check() == []
            assert len(files_in(root)) == 2 + bool(tenant)  # marker, the key's name (+ tenant file)
        assert b.delete_many([k]) == 1
        assert files_in(root) == [MARKER] and b.get_many([k]) == [None] and totals(b) == {}


def test_the_longest_keys_take_a_tenant_too(tmp_path):
    with FileBackend(tmp_path / "files") as b:
        long = b"\xab" * 120  # 240 hex characters: the tenant file is named by a digest
        assert b.put_many([(long, b"1")], tenant=b"t" * 16) == [True]
        assert b.put_many([(b"\xcd" * 120, b"2")]) == [True]
        assert b.get_many([long, b"\xcd" * 120]) == [b"1", b"2"]
        assert totals(b) == {b"t" * 16: (1, 1), b"": (1, 1)} and b.check() == []
        assert b.delete_many([long]) == 1 and totals(b) == {b"": (1, 1)}


def test_check_finds_tenant_files_no_key_links_to_and_links_to_nothing(tmp_path):
    root = tmp_path / "files"
    with FileBackend(root) as b:
        b.put_many([(key(A, 1), b"one"), (key(A, 2), b"two")], tenant=A)
        linked = file_of(root, key(A, 1))
        target = linked.parent / os.readlink(linked)
        os.unlink(linked)  # a crash between writing the tenant file and linking it, long ago
        os.utime(target, (time.time() - 2 * STALE_S,) * 2)
        os.unlink(file_of(root, key(A, 2)).parent / os.readlink(file_of(root, key(A, 2))))
        problems = b.check()
        assert any(p.startswith("tenant file no key links to") for p in problems), problems
        assert any(p.startswith("link to a missing tenant file") for p in problems), problems
        assert b.get_many([key(A, 1), key(A, 2)]) == [None, None] and totals(b) == {}
        assert b.check(fix=True) == problems and b.check() == []
        assert files_in(root) == [MARKER]
