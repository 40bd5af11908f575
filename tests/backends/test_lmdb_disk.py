"""LMDB tier scenarios in one process: restart, LRU, tiny maps, remaps under readers, drift
repair, pins, URLs. Real LMDB files under tmp_path; nothing is mocked."""

from __future__ import annotations

import threading

import lmdb
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage_backends.lmdb_disk import BackendClosed, InvalidKey, LmdbBackend, path_of
from storage_backends.registry import open_backend
from tests.backends.helpers import run_threads
from tiered_kv.errors import BackendError, ConfigError

KiB, MiB = 1 << 10, 1 << 20


def k(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8  # 32 bytes, like namespace digest + block key


def test_reopen_gives_back_usage_entries_lru_order_and_hits(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=MiB)
    b.put_many([(k(i), bytes([i]) * (1000 + i)) for i in range(5)])
    for i in (1, 3, 1):  # 3, then 1, are the most recently used
        b.get_many([k(i)])
    order, stats = b.lru_order(), b.stats()
    assert order == [k(0), k(2), k(4), k(3), k(1)]
    b.close()
    again = LmdbBackend(tmp_path / "db", capacity=MiB)
    assert again.lru_order() == order
    assert (again.stats().entries, again.stats().used_bytes) == (stats.entries, stats.used_bytes) == (5, 5010)
    assert again.entry_meta(k(1))["hits"] == 2 and again.entry_meta(k(0))["hits"] == 0
    assert again.get_many([k(i) for i in range(5)]) == [bytes([i]) * (1000 + i) for i in range(5)]
    assert again.check() == []
    again.close()


def test_eviction_follows_reads_recorded_in_memory(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=4 * 100 * KiB)
    b.put_many([(k(i), bytes(100 * KiB)) for i in range(4)])  # full
    b.get_many([k(0)])  # only buffered: the next write applies it before evicting
    b.put_many([(k(4), bytes(100 * KiB))])
    assert b.contains_many([k(i) for i in range(5)]) == [True, False, True, True, True]
    assert b.stats().evictions == 1 and b.check() == []
    b.close()


def test_reads_do_not_write_until_the_next_write_or_flush(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=MiB)
    b.put_many([(b"a", b"1"), (b"b", b"2")])
    before = b.env.info()["last_txnid"]
    for _ in range(50):
        b.get_many([b"a"])
        b.visit_many([b"b"], lambda i, v: None)
        b.contains_many([b"a"])
    assert b.env.info()["last_txnid"] == before, "a read must not cost a write transaction"
    assert b.stats().extra["pending_touches"] == 2
    b.flush()
    assert b.entry_meta(b"a")["hits"] == 50 and b.entry_meta(b"b")["hits"] == 50
    assert b.stats().extra["pending_touches"] == 0
    b.close()


def test_visit_many_hands_out_lmdb_pages_not_copies(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=8 * MiB, segment_min=4 * MiB)  # kept in LMDB's pages
    blob = np.random.default_rng(0).integers(0, 256, 2 * MiB, dtype=np.uint8).tobytes()
    b.put_many([(b"x", blob)])
    addresses = []

    def visitor(i: int, buf: memoryview) -> None:
        assert buf.readonly and buf.nbytes == len(blob) and buf == blob
        addresses.append(np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0])

    b.visit_many([b"x"], visitor)
    b.visit_many([b"x"], visitor)
    assert addresses[0] == addresses[1]  # the same mapped page both times
    b.close()


def test_a_capacity_smaller_than_the_data_evicts_and_a_tiny_map_never_fills(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=8 * MiB, map_size=256 * KiB, segment_min="1GiB")  # values in the map
    for i in range(30):
        assert b.put_many([(k(i), bytes([i]) * (256 * KiB))]) == [True]
    # one call far bigger than the capacity: grouped into transactions, evicting as it goes
    assert b.put_many([(k(100 + i), bytes([i]) * (300 * KiB)) for i in range(60)]) == [True] * 60
    stats = b.stats()
    assert stats.used_bytes <= 8 * MiB and stats.entries == 8 * MiB // (300 * KiB)
    assert stats.extra["map_size"] > 256 * KiB  # it grew instead of failing
    assert b.get_many([k(159)]) == [bytes([59]) * (300 * KiB)]
    assert b.check() == []
    b.close()


def test_map_growth_while_other_threads_read_zero_copy(tmp_path):
    """Remaps wait for the readers' transactions (their buffers point into the map), and the
    rolled-back write before each remap is not starved by readers that never pause (py-lmdb's
    abort waits for every call of the process in LMDB: this once took minutes)."""
    b = LmdbBackend(tmp_path / "db", capacity=64 * MiB, map_size=512 * KiB, segment_min="1GiB")  # values in the map
    b.put_many([(k(i), bytes([i]) * (64 * KiB)) for i in range(4)])
    errors: list[BaseException] = []
    done = threading.Event()
    start = b.stats().extra["map_size"]

    def reader() -> None:
        try:
            while not done.is_set():
                sums = []
                b.visit_many([k(i) for i in range(4)], lambda i, v, out=sums: out.append(sum(v[::4096])))
                assert sums == [i * 16 for i in range(4)]
        except BaseException as exc:
            errors.append(exc)

    def writer() -> None:
        try:
            for i in range(10, 50):  # 40 MiB through a 512 KiB map: remaps under the readers
                assert b.put_many([(k(i), bytes(MiB))]) == [True]
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    run_threads(reader, reader, writer)
    assert not errors, errors[0]
    assert b.stats().extra["map_size"] >= 4 * start and b.check() == []
    b.close()


def test_writer_and_reader_threads_through_a_tiny_map_neither_deadlock_nor_tear(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=4 * MiB, map_size=128 * KiB)
    errors: list[BaseException] = []
    writing = threading.Barrier(3)
    done = threading.Event()

    def writer(t: int) -> None:
        try:
            writing.wait()
            for i in range(30):
                size = (1000, 64 * KiB, 700 * KiB, 2 * MiB)[(i + t) % 4]
                assert b.put_many([(k(t * 100 + i), bytes([i]) * size)]) == [True]
        except BaseException as exc:
            errors.append(exc)

    def reader() -> None:
        def same_bytes(i: int, v: memoryview) -> None:
            assert set(v[::4096]) == {keys[i][3] % 100}

        try:
            writing.wait()
            while not done.is_set():
                keys = [k(t * 100 + i) for t in range(2) for i in range(0, 30, 3)]
                b.visit_many(keys, same_bytes)
        except BaseException as exc:
            errors.append(exc)

    def writers() -> None:
        run_threads(lambda: writer(0), lambda: writer(1))
        done.set()

    run_threads(writers, reader)
    assert not errors, errors[0]
    assert b.stats().used_bytes <= 4 * MiB and b.check() == []
    b.close()


def test_check_finds_drift_and_fix_repairs_it(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=MiB)
    b.put_many([(c, c * 100) for c in (b"a", b"b", b"c", b"d")])
    with b.env.begin(write=True) as txn:  # damage behind the backend's back
        txn.delete(b"a", db=b.meta)
        txn.delete(b"b", db=b.blocks)
        txn.put(b"c", b"c" * 7, db=b.blocks)  # the meta table still says 100
        txn.put(b"\x00" * 8 + b"d", b"", db=b.lru)  # a second, stale LRU entry
    problems = b.check()
    for expected in ("block without meta: 61", "meta without block: 62",
                     "meta size 100 != stored size 7: 63", "stale LRU entry: 64", "info totals"):
        assert any(p.startswith(expected) for p in problems), (expected, problems)
    assert b.check() == problems  # checking alone repairs nothing
    assert b.check(fix=True) == problems
    assert b.check() == []
    assert b.get_many([b"a", b"b", b"c", b"d"]) == [b"a" * 100, None, b"c" * 7, b"d" * 100]
    assert (b.stats().entries, b.stats().used_bytes) == (3, 207)
    assert b.lru_order()[0] == b"a"  # a repaired entry has no history: it goes first
    b.close()


def test_pinned_keys_survive_eviction_pressure_until_the_last_unpin(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=MiB)
    b.put_many([(b"keep", b"k" * 200_000)])
    b.pin_many([b"keep"])
    b.pin_many([b"keep"])  # two leases
    for i in range(20):
        assert b.put_many([(k(i), b"v" * 200_000)]) == [True]
    assert b.contains_many([b"keep"]) == [True]
    b.unpin_many([b"keep"])
    b.put_many([(k(i), b"v" * 200_000) for i in range(20, 30)])
    assert b.contains_many([b"keep"]) == [True]  # one lease is left
    b.unpin_many([b"keep"])
    b.put_many([(k(i), b"v" * 200_000) for i in range(30, 40)])
    assert b.contains_many([b"keep"]) == [False]
    b.close()


def test_no_room_because_everything_is_pinned_is_a_refusal(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=MiB)
    keys = [k(i) for i in range(4)]
    b.put_many([(key, bytes(250 * KiB)) for key in keys])
    b.pin_many(keys)
    assert b.put_many([(b"more", bytes(100 * KiB))]) == [False]
    assert b.stats().put_rejected == 1 and b.contains_many(keys) == [True] * 4
    b.unpin_many(keys)
    assert b.put_many([(b"more", bytes(100 * KiB))]) == [True]
    b.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "put", "get", "delete"]),
                              st.integers(0, 9), st.integers(0, 40_000)), max_size=40))
def test_totals_and_tables_agree_after_any_operations(tmp_path_factory, ops):
    b = LmdbBackend(tmp_path_factory.mktemp("db"), capacity=100_000)
    try:
        for op, i, size in ops:
            if op == "put":
                b.put_many([(k(i), bytes([i]) * size)])
            elif op == "get":
                b.get_many([k(i)])
            else:
                b.delete_many([k(i)])
        present = [v for v in b.get_many([k(i) for i in range(10)]) if v is not None]
        stats = b.stats()
        assert (stats.entries, stats.used_bytes) == (len(present), sum(map(len, present)))
        assert stats.used_bytes <= 100_000
        assert b.check() == []
    finally:
        b.close()


def test_url_forms_and_options(tmp_path, monkeypatch):
    assert path_of("lmdb:///abs/dir?capacity=1GiB") == path_of("lmdb:///abs/dir") == \
        __import__("pathlib").Path("/abs/dir")
    assert str(path_of("lmdb://./rel/dir")) == "rel/dir"
    assert str(path_of("lmdb:rel")) == "rel"
    assert str(path_of("lmdb:///with%20space")) == "/with space"
    b = open_backend(f"lmdb://{tmp_path}/x?capacity=2MiB&sync=1&readahead=no&batch_bytes=1MiB")
    assert (b.capacity, b.sync, b.batch_bytes) == (2 * MiB, True, MiB)
    b.close()
    b = open_backend(f"lmdb://{tmp_path}/x?capacity=2MiB", capacity="3MiB", map_size=64 * MiB)
    assert b.capacity == 3 * MiB and b.stats().extra["map_size"] >= 64 * MiB  # keywords win
    b.close()
    monkeypatch.chdir(tmp_path)
    b = LmdbBackend.from_url("lmdb:rel?capacity=1MiB")  # (the registry wants "lmdb://" today)
    b.put_many([(b"a", b"1")])
    b.close()
    assert (tmp_path / "rel" / "data.mdb").exists()
    for url, match in ((f"lmdb://{tmp_path}/y?colour=red", "unknown lmdb option"),
                       (f"lmdb://{tmp_path}/y?capacity=lots", "capacity"),
                       (f"lmdb://{tmp_path}/y?capacity=0", "capacity"),
                       (f"lmdb://{tmp_path}/y?sync=maybe", "sync"),
                       ("lmdb://", "names no directory")):
        with pytest.raises(ConfigError, match=match):
            open_backend(url)
    (tmp_path / "file").write_text("not a store")
    with pytest.raises(ConfigError, match="not a directory"):
        open_backend(f"lmdb://{tmp_path}/file")


def test_opening_garbage_or_another_format_is_a_config_error(tmp_path):
    d = tmp_path / "db"
    d.mkdir()
    (d / "data.mdb").write_bytes(b"this is not an lmdb file" * 1000)
    with pytest.raises(ConfigError, match="cannot open LMDB"):
        LmdbBackend(d, capacity=MiB)
    LmdbBackend(tmp_path / "new", capacity=MiB).close()
    with lmdb.open(str(tmp_path / "new"), max_dbs=8) as env:
        with env.begin(write=True) as txn:
            txn.put(b"format", (99).to_bytes(8, "little"), db=env.open_db(b"info", txn=txn))
    with pytest.raises(ConfigError, match="format 99"):
        LmdbBackend(tmp_path / "new", capacity=MiB)


def test_bad_keys_are_typed_errors_for_writes_and_misses_for_reads(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=MiB)
    for bad in (b"", b"x" * 512):
        with pytest.raises(InvalidKey):
            b.put_many([(b"fine", b"1"), (bad, b"2")])
        assert b.get_many([bad]) == [None] and b.contains_many([bad]) == [False]
        assert b.delete_many([bad]) == 0
    with pytest.raises(InvalidKey):
        b.put_many([("text", b"1")])
    assert b.get_many([b"fine"]) == [None]  # a rejected call writes nothing
    assert b.put_many([(bytearray(b"x" * 511), memoryview(b"v"))]) == [True]
    assert b.get_many([b"x" * 511]) == [b"v"]
    b.close()


def test_close_applies_reads_and_later_use_is_an_error(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=MiB)
    b.put_many([(b"a", b"1")])
    with pytest.raises(BackendError, match="inside"):
        b.visit_many([b"a"], lambda i, v: b.close())
    b.get_many([b"a"])
    b.close()
    b.close()
    for call in (lambda: b.get_many([b"a"]), lambda: b.put_many([(b"a", b"2")]), b.stats, b.flush):
        with pytest.raises(BackendClosed):
            call()
    again = LmdbBackend(tmp_path / "db", capacity=MiB)
    assert again.entry_meta(b"a")["hits"] == 1  # the get, applied by close (the failed visit: not)
    again.close()


def test_stats_report_the_medium(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=MiB)
    b.put_many([(b"a", bytes(5000))])
    b.pin_many([b"a"])
    stats = b.stats()
    assert (stats.name, stats.capacity_bytes, stats.bytes_in) == ("lmdb", MiB, 5000)
    extra = stats.extra
    assert extra["page_size"] >= 4096 and extra["map_size"] >= MiB
    assert 5000 <= extra["file_allocated_bytes"] and 5000 <= extra["file_bytes"] <= extra["map_size"]
    assert extra["pinned"] == 1 and extra["pending_touches"] == 0
    b.close()


def test_the_longest_keys_take_part_in_the_lru(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=3000)
    long = [bytes([i]) * 511 for i in range(3)]  # too long to follow the time in the index
    b.put_many([(key, bytes(1000)) for key in long])
    b.get_many([long[0]])
    assert b.lru_order() == [long[1], long[2], long[0]]
    b.put_many([(b"short", bytes(1000))])
    assert b.contains_many([*long, b"short"]) == [True, False, True, True]
    assert b.check() == [] and b.delete_many(long) == 2 and b.check() == []
    b.close()
