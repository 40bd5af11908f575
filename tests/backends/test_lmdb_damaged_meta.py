"""The LMDB tier with a damaged ``meta`` record: too short to be one, or with a tenant tail longer
than a tenant label (16 bytes) or than a length byte can say (255). One read of such an entry
used to leave an access in the buffer that made every later write transaction raise a bare
ValueError / struct.error (puts of other keys, flush, close), and check() crashed on it. Now the
record is counted (``damaged_meta``), passed over by reads, dropped by a delete, an overwrite or
an eviction, reported by check() and rebuilt by check(fix=True). Real LMDB files under tmp_path."""

from __future__ import annotations

import pytest

from storage_backends.lmdb_disk import LmdbBackend
from storage_backends.lmdb_tables import META
from tests.store.helpers import keys_for, load, make_store, payloads
from tiered_kv.errors import CorruptBlock, DamagedRecord

KiB, MiB = 1 << 10, 1 << 20
A, B = b"tenant-a", b"tenant-b"
DAMAGE = {
    "short": lambda record: b"short",
    "tail over a length byte": lambda record: record[: META.size] + b"\xff" * 300,
    "tail over a label": lambda record: record[: META.size] + b"\xee" * 17,
}
WEDGING = ["short", "tail over a length byte"]  # the two that used to fail every later write


def damage_meta(b: LmdbBackend, key: bytes, how: str) -> None:
    """Rewrite ``key``'s meta record behind the tier's back."""
    with b.env.begin(write=True) as txn:
        record = bytes(txn.get(key, db=b.meta))
        txn.put(key, DAMAGE[how](record), db=b.meta)


def damaged_store(tmp_path, how: str, **options) -> LmdbBackend:
    b = LmdbBackend(tmp_path / "db", capacity=options.pop("capacity", MiB), **options)
    assert b.put_many([(b"a", b"1" * 10), (b"b", b"2" * 20)], tenant=A) == [True, True]
    damage_meta(b, b"a", how)
    return b


@pytest.mark.parametrize("how", WEDGING)
def test_regression_one_read_of_a_damaged_meta_record_wedged_every_later_write(tmp_path, how):
    b = damaged_store(tmp_path, how)
    assert b.get_many([b"a"]) == [b"1" * 10]  # the value itself is fine: served, its access buffered
    for i in range(3):  # other keys, another tenant: nothing to do with "a"
        assert b.put_many([(b"k%d" % i, b"x" * 10)], tenant=B) == [True]
    b.flush()
    stats = b.stats()
    assert stats.extra["pending_touches"] == 0  # the bad access was passed over, not kept
    assert stats.extra["damaged_meta"] >= 1
    b.close()
    again = LmdbBackend(tmp_path / "db", capacity=MiB)  # the later puts reached the disk
    assert again.get_many([b"k0", b"k1", b"k2"]) == [b"x" * 10] * 3
    again.close()


@pytest.mark.parametrize("how", list(DAMAGE))
def test_regression_check_crashed_on_a_damaged_meta_record_and_fix_rebuilds_it(tmp_path, how):
    b = damaged_store(tmp_path, how)
    b.get_many([b"a"])  # check applies the pending accesses first
    assert "unreadable meta record: 61" in b.check()
    assert "unreadable meta record: 61" in b.check(fix=True)
    assert b.check() == []
    meta = b.entry_meta(b"a")  # rebuilt from the stored value, its tenant unknown
    assert (meta["size"], meta["tenant"]) == (10, b"")
    assert b.get_many([b"a", b"b"]) == [b"1" * 10, b"2" * 20]
    assert (b.stats().entries, b.stats().used_bytes) == (2, 30)
    b.close()


@pytest.mark.parametrize("how", WEDGING)
def test_regression_overwriting_a_key_whose_meta_record_is_damaged_crashed(tmp_path, how):
    b = damaged_store(tmp_path, how)
    assert b.put_many([(b"a", b"3" * 40)], tenant=A) == [True]
    assert b.get_many([b"a"]) == [b"3" * 40]
    assert b.entry_meta(b"a")["tenant"] == A
    assert (b.stats().entries, b.stats().used_bytes) == (2, 60)  # the old value's bytes left the totals
    b.check(fix=True)  # a short record held no last access: its index entries were left to check
    assert b.check() == []
    b.close()


def test_an_overwrite_of_a_damaged_entry_keeps_every_total_right_when_the_index_still_tells_its_tenant(tmp_path):
    b = damaged_store(tmp_path, "tail over a length byte")  # the record's head still holds its last access
    assert b.put_many([(b"a", b"3" * 40)], tenant=B) == [True]
    assert b.check() == []
    assert {t: tuple(v) for t, v in b.tenant_totals().items()} == {A: (20, 1), B: (40, 1)}
    b.close()


@pytest.mark.parametrize("how", list(DAMAGE))
def test_a_damaged_entry_can_be_deleted(tmp_path, how):
    b = damaged_store(tmp_path, how)
    b.get_many([b"a"])
    assert b.delete_many([b"a"]) == 1
    assert b.contains_many([b"a", b"b"]) == [False, True]
    assert (b.stats().entries, b.stats().used_bytes) == (1, 20)
    b.check(fix=True)
    assert b.check() == []
    b.close()


@pytest.mark.parametrize("how", list(DAMAGE))
def test_a_damaged_entry_in_a_segment_file_is_evicted_for_its_stored_bytes(tmp_path, how):
    b = LmdbBackend(tmp_path / "db", capacity=300 * KiB)
    assert b.put_many([(b"old", b"o" * 100 * KiB)], tenant=A) == [True]  # a segment's value
    assert b.put_many([(b"mid", b"m" * 100 * KiB)], tenant=A) == [True]
    damage_meta(b, b"old", how)
    b.get_many([b"old"])
    assert b.put_many([(b"new", b"n" * 150 * KiB)], tenant=B) == [True]  # the oldest must go
    assert b.contains_many([b"old", b"mid", b"new"]) == [False, True, True]
    assert b.stats().evictions == 1 and b.stats().used_bytes == 250 * KiB
    b.check(fix=True)
    assert b.check() == []
    b.close()


def test_entry_meta_of_a_damaged_record_is_a_typed_error(tmp_path):
    b = damaged_store(tmp_path, "tail over a length byte")
    with pytest.raises(DamagedRecord, match="unreadable meta record") as caught:
        b.entry_meta(b"a")
    assert isinstance(caught.value, CorruptBlock)
    b.close()


def test_regression_a_damaged_meta_record_read_once_by_a_load_lost_every_later_disk_save(tmp_path):
    with make_store(tmp_path, host="64KiB") as store:  # 4 host slots: loads come from the disk
        disk = store.tier("disk")
        keys, data = keys_for(8), payloads(store, 8)
        store.save(keys[:1], data[:1])
        assert store.flush(30)
        damage_meta(disk.backend, disk.ns + keys[0], "tail over a length byte")
        store.host.delete_many(keys[:1])
        assert load(store, keys[:1])[0] == [True]  # served from the disk: its access buffered
        for k, p in zip(keys[1:], data[1:]):
            store.save([k], [p])
            assert store.flush(30)  # used to raise ValueError from the disk tier
        assert disk.contains(keys[1:]) == [True] * 7
        assert disk.backend.stats().extra["damaged_meta"] >= 1


def test_regression_an_access_that_failed_to_apply_was_put_back_and_failed_every_later_write(tmp_path, monkeypatch):
    from storage_backends import lmdb_environment

    applied = lmdb_environment.apply_accesses

    def fails_on_a(tables, w, touches):  # any fault an access could meet, not only damage
        if b"a" in touches:
            raise RuntimeError("an access that cannot be applied")
        applied(tables, w, touches)

    monkeypatch.setattr(lmdb_environment, "apply_accesses", fails_on_a)
    b = LmdbBackend(tmp_path / "db", capacity=MiB)
    b.put_many([(b"a", b"1" * 10)], tenant=A)
    b.get_many([b"a"])
    with pytest.raises(RuntimeError):
        b.put_many([(b"k0", b"x")], tenant=B)
    assert b.put_many([(b"k1", b"x")], tenant=B) == [True]  # dropped, not put back
    assert b.stats().extra["pending_touches"] == 0
    b.close()


def test_accesses_stay_buffered_when_the_write_that_applied_them_fails_for_its_own_reasons(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=MiB)
    b.put_many([(b"a", b"1"), (b"b", b"2")])
    b.get_many([b"a"])
    with pytest.raises(ZeroDivisionError):
        b._db.write(lambda w: 1 / 0)  # the body failed, not the accesses: they are kept
    assert b.stats().extra["pending_touches"] == 1
    assert b.lru_order() == [b"b", b"a"] and b.entry_meta(b"a")["hits"] == 1
    b.close()


def test_regression_the_tools_stopped_at_a_damaged_meta_record(tmp_path):
    """``tiered-kv ls`` and ``copy`` asked the medium for each entry's meta data, and a damaged
    record ended the command (exit 2) at that entry. It is listed (its meta data unknown) and copied."""
    from tests.cli.conftest import cli
    from tests.store.helpers import NS

    keys = keys_for(4)
    with make_store(tmp_path) as store:
        store.save(keys, payloads(store, 4))
        assert store.flush(30)
    backend = LmdbBackend(tmp_path / "lmdb", capacity=64 * MiB)
    damage_meta(backend, NS.digest() + keys[0], "short")
    backend.close()

    listing = cli("ls", tmp_path / "lmdb", "--json")
    assert listing.code in (0, 1), listing.err
    rows = listing.json()["tiers"][0]["rows"]
    assert len(rows) == 4 and sum(r["hits"] is None for r in rows) == 1, rows  # (its meta data unknown)
    copied = cli("copy", f"lmdb://{tmp_path / 'lmdb'}", f"lmdb://{tmp_path / 'copy'}", "--json")
    assert copied.code == 0 and copied.json()["copied"] == 4, copied.out + copied.err
