"""Tenants in the LMDB tier: the tenant of every entry and the bytes each tenant holds live in the
environment, so quotas and usage survive a restart and stay right with several processes; an
environment written before tenants (format 1) is upgraded in place when opened. Real LMDB files."""

from __future__ import annotations

import hashlib
import struct

import lmdb
import pytest

import storage_backends.lmdb_format as lmdb_format
from storage_backends.base import Unchecked
from storage_backends.lmdb_disk import LmdbBackend
from storage_backends.lmdb_tables import FORMAT, TOTALS, tenant_prefix
from tests.backends import test_lmdb_processes as processes

KiB, MiB = 1 << 10, 1 << 20
UNIT = 100 * KiB
A, B = b"tenant-a", b"tenant-b"


def key(tenant: bytes, i: int) -> bytes:
    return tenant[-1:] * 16 + i.to_bytes(16, "big")


def totals(b: LmdbBackend) -> dict[bytes, tuple[int, int]]:
    return {tenant: tuple(t) for tenant, t in b.tenant_totals().items()}


def test_usage_and_quota_order_survive_a_restart(tmp_path):
    with LmdbBackend(tmp_path / "db", capacity=64 * MiB, tenant_quota=3 * UNIT) as b:
        for i in (1, 2, 3):
            b.put_many([(key(A, i), bytes(UNIT))], tenant=A)
        b.put_many([(key(B, 1), bytes(UNIT))], tenant=B)
        b.get_many([key(A, 1)])  # A's 2 is its least recently used from here on
    with LmdbBackend(tmp_path / "db", capacity=64 * MiB) as b:  # no quota: usage is still kept
        assert totals(b) == {A: (3 * UNIT, 3), B: (UNIT, 1)}
        assert b.entry_meta(key(A, 1))["tenant"] == A
    with LmdbBackend(tmp_path / "db", capacity=64 * MiB, tenant_quota=3 * UNIT) as b:
        assert b.put_many([(key(A, 4), bytes(UNIT))], tenant=A) == [True]
        assert b.contains_many([key(A, i) for i in (1, 2, 3, 4)]) == [True, False, True, True]
        assert totals(b) == {A: (3 * UNIT, 3), B: (UNIT, 1)} and b.check() == []


def write_format_1(path, entries: list[tuple[bytes, bytes, int]]) -> None:
    """An environment as the version before tenants wrote it: (key, value, last access ns)."""
    meta, stamp = struct.Struct("<QQIQ"), struct.Struct(">Q")
    path.mkdir()
    with lmdb.open(str(path), max_dbs=8) as env:
        blocks, metas, lru, info = (env.open_db(n) for n in (b"blocks", b"meta", b"lru", b"info"))
        with env.begin(write=True) as txn:
            for k, v, atime in entries:
                txn.put(k, v, db=blocks)
                txn.put(k, meta.pack(len(v), atime, 1, atime), db=metas)
                long = len(k) > 511 - stamp.size
                index = stamp.pack(atime) + (hashlib.blake2b(k, digest_size=16).digest() if long else k)
                txn.put(index, k if long else b"", db=lru)
            txn.put(b"used", struct.pack("<Q", sum(len(v) for _, v, _ in entries)), db=info)
            txn.put(b"entries", struct.pack("<Q", len(entries)), db=info)
            txn.put(b"format", struct.pack("<Q", 1), db=info)


def test_a_format_1_environment_is_upgraded_in_place_all_of_it_no_tenants(tmp_path, monkeypatch):
    monkeypatch.setattr(lmdb_format, "CHUNK", 2)  # several cursor passes over the meta table
    old = [(bytes([i]) * 32, bytes([i]) * (1000 + i), 1000 * (5 - i)) for i in range(5)]
    old.append((b"L" * 511, b"long key", 1))  # indexed by a digest
    write_format_1(tmp_path / "db", old)
    with LmdbBackend(tmp_path / "db", capacity=MiB) as b:
        assert b.check() == []
        assert totals(b) == {b"": (sum(len(v) for _, v, _ in old), 6)}
        assert b.lru_order() == [b"L" * 511] + [bytes([i]) * 32 for i in (4, 3, 2, 1, 0)]
        assert b.get_many([k for k, _, _ in old]) == [v for _, v, _ in old]
        b.flush()
        assert b.entry_meta(old[0][0])["tenant"] == b"" and b.entry_meta(old[0][0])["hits"] == 2
        b.put_many([(key(A, 1), bytes(100))], tenant=A)
    with lmdb.open(str(tmp_path / "db"), max_dbs=8) as env, env.begin() as txn:
        assert struct.unpack("<Q", txn.get(b"format", db=env.open_db(b"info", txn=txn)))[0] == FORMAT == 3
    with LmdbBackend(tmp_path / "db", capacity=MiB) as b:  # opened again: nothing more to do
        assert totals(b)[b""][1] == 6 and totals(b)[A] == (100, 1) and b.check() == []


def test_regression_a_read_only_check_of_a_format_1_store_missed_every_entry_in_the_tenant_tables(tmp_path):
    """Opened read-only, a format 1 store keeps no tenant tables until its first write: their
    check is left out and said so (it was a missing tenant LRU entry per key and wrong tenant
    totals); the rest is still checked, and ``fix`` (a write) upgrades it, then checks it all."""
    old = [(bytes([i]) * 32, bytes([i]) * (1000 + i), 1000 * (5 - i)) for i in range(3)]
    write_format_1(tmp_path / "db", old)
    with lmdb.open(str(tmp_path / "db"), max_dbs=8) as env, env.begin(write=True) as txn:
        txn.delete(struct.pack(">Q", 1000 * 5) + old[0][0], db=env.open_db(b"lru", txn=txn))  # real drift
    tool = LmdbBackend.open_read_only(f"lmdb://{tmp_path / 'db'}")
    problems = tool.check()
    assert problems == [f"missing LRU entry: {old[0][0].hex()}",
                        "format 1: upgraded by the first write; tenant bookkeeping not checked"]
    assert [type(p) for p in problems] == [str, Unchecked]
    assert tool.check(fix=True) == problems[:1] and tool.check() == []
    assert totals(tool) == {b"": (sum(len(v) for _, v, _ in old), 3)}
    tool.close()


def test_check_finds_and_repairs_drift_in_the_tenant_tables(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=MiB)
    b.put_many([(b"a", b"a" * 100), (b"b", b"b" * 100)], tenant=A)
    b.put_many([(b"c", b"c" * 100)], tenant=B)
    tenant_lru, tenants = b._db.tables.tenant_lru, b._db.tables.tenants
    with b.env.begin(write=True) as txn:  # damage behind the backend's back
        txn.put(tenant_prefix(A), TOTALS.pack(7, 1), db=tenants)
        txn.delete(tenant_prefix(B), db=tenants)
        cursor = txn.cursor(db=tenant_lru)
        cursor.set_range(tenant_prefix(B))
        cursor.delete()  # c's entry
        txn.put(tenant_prefix(A) + bytes(8) + b"zz", b"", db=tenant_lru)
    problems = b.check()
    for expected in ("tenant totals of " + A.hex(), "tenant totals of " + B.hex(),
                     "missing tenant LRU entry: 63", "stale tenant LRU entry: 7a7a"):
        assert any(p.startswith(expected) for p in problems), (expected, problems)
    assert b.check(fix=True) == problems and b.check() == []
    assert totals(b) == {A: (200, 2), B: (100, 1)}
    b.close()


def test_a_damaged_meta_record_is_a_problem_not_a_crash(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=MiB)
    b.put_many([(b"a", b"1" * 10)], tenant=A)
    with b.env.begin(write=True) as txn:
        txn.put(b"a", b"short", db=b.meta)
    assert "unreadable meta record: 61" in b.check()
    b.check(fix=True)
    assert b.check() == [] and totals(b) == {b"": (10, 1)}  # its tenant is lost with its record
    b.close()


def test_processes_of_several_tenants_keep_usage_and_quotas_right(tmp_path):
    db = str(tmp_path / "db")
    body = f"""
        tag = sys.argv[1].encode()
        b = LmdbBackend({db!r}, capacity=64 << 20, map_size=256 << 10, tenant_quota=1 << 20)
        for i in range(60):
            assert b.put_many([(key(tag.decode(), i), value(i, 50_000 + i))], tenant=tag) == [True]
            if i % 10 == 9:
                b.delete_many([key(tag.decode(), i - 5)])
        b.close()
    """
    procs = [processes.child(body, tag) for tag in ("A", "B", "C")]
    reader = LmdbBackend(db, capacity=64 * MiB)  # this process reads meanwhile
    while any(p.poll() is None for p in procs):
        reader.tenant_totals()
        reader.get_many([processes.key(t, i) for t in "ABC" for i in range(0, 60, 7)])
    for p in procs:
        processes.finish(p)
    assert reader.check() == []
    held = {t.encode(): list(reader.scan(t.encode().ljust(16, b"\0"))) for t in "ABC"}
    for tenant, keys in held.items():
        sizes = [len(v) for v in reader.get_many(keys)]
        assert totals(reader)[tenant] == (sum(sizes), len(keys))
        assert sum(sizes) <= 1 << 20 and all(reader.entry_meta(k)["tenant"] == tenant for k in keys)
    assert reader.stats().extra["quota_evictions"] == 0  # the children's, not this process's
    reader.close()


@pytest.mark.parametrize("quota, error", [("0", "must be positive"), ("lots", "tenant_quota")])
def test_a_bad_quota_in_a_url_is_a_config_error(tmp_path, quota, error):
    from storage_backends.registry import open_backend
    from tiered_kv.errors import ConfigError

    with pytest.raises(ConfigError, match=error):
        open_backend(f"lmdb://{tmp_path}/db?capacity=1MiB&tenant_quota={quota}")
