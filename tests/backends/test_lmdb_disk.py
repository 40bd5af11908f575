"""LMDB tier scenarios: restart, several processes, tiny maps, drift repair, pins."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import lmdb
import pytest

from storage_backends.lmdb_disk import LmdbBackend, path_of
from storage_backends.registry import open_backend
from tiered_kv.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_reopen_gives_back_usage_entries_and_lru_order(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=1 << 20)
    b.put_many([(bytes([i]) * 4, bytes([i]) * (1000 + i)) for i in range(5)])
    b.get_many([bytes([1]) * 4])  # key 1 becomes the most recently used
    order, stats = b.lru_order(), b.stats()
    b.close()
    again = LmdbBackend(tmp_path / "db", capacity=1 << 20)
    assert again.lru_order() == order
    assert order[-1] == bytes([1]) * 4
    assert (again.stats().entries, again.stats().used_bytes) == (stats.entries, stats.used_bytes) == (5, 5010)
    assert again.entry_meta(bytes([1]) * 4)["hits"] == 1
    again.close()


def test_a_child_process_writes_and_exits_then_everything_reads_back(tmp_path):
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(REPO)!r})
        from storage_backends.lmdb_disk import LmdbBackend
        b = LmdbBackend({str(tmp_path / 'db')!r}, capacity=1 << 24)
        b.put_many([(i.to_bytes(4, 'big'), bytes([i % 251]) * 70000) for i in range(40)])
        b.flush()
        print(b.stats().used_bytes)
    """)
    used = int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)
    b = LmdbBackend(tmp_path / "db", capacity=1 << 24)
    values = b.get_many([i.to_bytes(4, "big") for i in range(40)])
    assert values == [bytes([i % 251]) * 70000 for i in range(40)]
    assert b.stats().used_bytes == used == 40 * 70000
    b.close()


def test_two_processes_writing_one_directory_keep_the_totals_right(tmp_path):
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(REPO)!r})
        from storage_backends.lmdb_disk import LmdbBackend
        tag = sys.argv[1].encode()
        b = LmdbBackend({str(tmp_path / 'db')!r}, capacity=3 << 20)
        for i in range(60):
            b.put_many([(tag + i.to_bytes(2, 'big'), b'x' * 50000)])
            b.get_many([tag + (i // 2).to_bytes(2, 'big')])
        b.close()
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, tag]) for tag in ("A", "B")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    b = LmdbBackend(tmp_path / "db", capacity=3 << 20)
    assert b.check() == []
    assert b.stats().used_bytes <= 3 << 20
    assert b.stats().entries == len(list(b.scan()))
    b.close()


def test_a_tiny_map_never_raises_map_full(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=8 << 20, map_size=1 << 20)
    for i in range(30):
        assert b.put_many([(bytes([i]), b"z" * (256 << 10))]) == [True]
    assert b.stats().used_bytes <= 8 << 20
    assert b.check() == []
    b.close()


def test_check_finds_drift_and_fix_repairs_it(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=1 << 20)
    b.put_many([(b"a", b"1" * 100), (b"b", b"2" * 100), (b"c", b"3" * 100)])
    with b.env.begin(write=True) as txn:  # damage behind the backend's back
        txn.delete(b"a", db=b.meta)
        txn.delete(b"b", db=b.blocks)
    problems = b.check()
    assert any("block without meta" in p for p in problems)
    assert any("meta without block" in p for p in problems)
    assert any("info totals" in p for p in problems)
    assert b.check(fix=True) == problems
    assert b.check() == []
    assert b.get_many([b"a", b"b", b"c"]) == [b"1" * 100, None, b"3" * 100]
    assert b.stats().entries == 2
    b.close()


def test_pinned_keys_survive_eviction_pressure(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=1 << 20)
    b.put_many([(b"keep", b"k" * 200_000)])
    b.pin_many([b"keep"])
    for i in range(20):
        b.put_many([(bytes([i]), b"v" * 200_000)])
    assert b.contains_many([b"keep"]) == [True]
    b.unpin_many([b"keep"])
    for i in range(20, 30):
        b.put_many([(bytes([i]), b"v" * 200_000)])
    assert b.contains_many([b"keep"]) == [False]
    b.close()


def test_url_forms_and_bad_options(tmp_path):
    assert path_of("lmdb:///abs/dir?capacity=1GiB") == Path("/abs/dir")
    assert path_of("lmdb://./rel/dir") == Path("./rel/dir")
    assert path_of("lmdb:rel") == Path("rel")
    b = open_backend(f"lmdb://{tmp_path}/x?capacity=2MiB&sync=1")
    assert b.capacity == 2 << 20
    b.close()
    with pytest.raises(ConfigError, match="unknown lmdb option"):
        open_backend(f"lmdb://{tmp_path}/y?colour=red")
    with pytest.raises(ConfigError, match="capacity"):
        open_backend(f"lmdb://{tmp_path}/z?capacity=lots")
    (tmp_path / "file").write_text("not a store")
    with pytest.raises(ConfigError, match="not a directory"):
        open_backend(f"lmdb://{tmp_path}/file")


def test_reads_do_not_write_until_the_next_write_or_flush(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=1 << 20)
    b.put_many([(b"a", b"1"), (b"b", b"2")])
    before = b.env.info()["last_txnid"]
    for _ in range(50):
        b.get_many([b"a"])
    assert b.env.info()["last_txnid"] == before, "a read must not cost a write transaction"
    b.flush()
    assert b.entry_meta(b"a")["hits"] == 50
    b.close()


def test_opening_garbage_as_a_store_is_a_config_error(tmp_path):
    d = tmp_path / "db"
    d.mkdir()
    (d / "data.mdb").write_bytes(b"this is not an lmdb file" * 100)
    with pytest.raises(ConfigError, match="cannot open LMDB"):
        LmdbBackend(d, capacity=1 << 20)
    assert lmdb  # the module is the real one
