"""Tools find and open existing stores through the media: ``url_for_path`` asks every registered
medium whether a directory holds one of its stores, ``open_read_only`` opens one without creating
anything and without recording the tools' reads as accesses. Real LMDB files, file stores and a
real redis-server."""

from __future__ import annotations

import socket

import pytest

from storage_backends import registry
from storage_backends.file_dir import FileBackend
from storage_backends.host import HostBackend
from storage_backends.lmdb_disk import LmdbBackend
from storage_backends.registry import open_backend, open_read_only, url_for_path
from tiered_kv.errors import BackendUnavailable, ConfigError

MiB = 1 << 20


def lmdb_store(path, n: int = 4) -> None:
    with LmdbBackend(path, capacity=MiB) as b:
        b.put_many([(bytes([i]) * 32, bytes([i]) * 100) for i in range(n)])


def file_store(path, n: int = 4) -> None:
    with FileBackend(path) as b:
        b.put_many([(bytes([i]) * 32, bytes([i]) * 100) for i in range(n)])


def test_a_directory_is_recognised_by_the_medium_that_made_it(tmp_path):
    lmdb_store(tmp_path / "disk")
    file_store(tmp_path / "files")
    assert url_for_path(tmp_path / "disk") == f"lmdb://{tmp_path / 'disk'}"
    assert url_for_path(str(tmp_path / "files")) == f"file://{tmp_path / 'files'}"
    assert LmdbBackend.store_url_at(tmp_path / "files") is None
    assert FileBackend.store_url_at(tmp_path / "disk") is None
    assert HostBackend.store_url_at(tmp_path / "disk") is None


def test_a_path_without_a_store_says_what_it_is(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "plain.txt").write_text("hello")
    with pytest.raises(ConfigError, match="no store at .*missing: the path does not exist"):
        url_for_path(tmp_path / "missing")
    with pytest.raises(ConfigError, match="plain.txt is a file"):
        url_for_path(tmp_path / "plain.txt")
    with pytest.raises(ConfigError, match=r"empty is not a tiered-kv store \(no LMDB data.mdb, no file-store marker\)"):
        url_for_path(tmp_path / "empty")


def test_a_medium_that_cannot_be_imported_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, "broken", "storage_backends.no_such_medium:Nothing")
    lmdb_store(tmp_path / "disk")
    assert url_for_path(tmp_path / "disk").startswith("lmdb://")


def test_reading_an_lmdb_store_read_only_leaves_lru_order_and_hits_alone(tmp_path):
    lmdb_store(tmp_path / "disk")
    with LmdbBackend(tmp_path / "disk", capacity=MiB) as b:
        order, hits = b.lru_order(), [b.entry_meta(k)["hits"] for k in b.lru_order()]
    with open_read_only(str(tmp_path / "disk")) as tool:  # a bare path works too
        assert tool.get_many([bytes([0]) * 32, bytes([2]) * 32]) == [bytes([0]) * 100, bytes([2]) * 100]
        tool.visit_many([bytes([0]) * 32], lambda i, v: None)
        assert tool.stats().extra["pending_touches"] == 0
    with LmdbBackend(tmp_path / "disk", capacity=MiB) as b:
        assert b.lru_order() == order and [b.entry_meta(k)["hits"] for k in order] == hits


def test_what_a_tool_asks_for_still_happens_on_a_read_only_store(tmp_path):
    lmdb_store(tmp_path / "disk")
    with open_read_only(f"lmdb://{tmp_path / 'disk'}") as tool:
        assert tool.delete_many([bytes([1]) * 32]) == 1  # `tiered-kv evict`
    with LmdbBackend(tmp_path / "disk", capacity=MiB) as b:
        assert b.stats().entries == 3 and b.check() == []


def test_opening_read_only_never_creates_a_store(tmp_path):
    (tmp_path / "empty").mkdir()
    for url, match in ((f"lmdb://{tmp_path / 'nothing'}", "no store at"),
                       (f"lmdb://{tmp_path / 'empty'}", "not an LMDB store"),
                       (f"file://{tmp_path / 'nothing'}", "no store at"),
                       (f"file://{tmp_path / 'empty'}", "not a file store")):
        with pytest.raises(ConfigError, match=match):
            open_read_only(url)
    assert not (tmp_path / "nothing").exists() and list((tmp_path / "empty").iterdir()) == []


def test_reading_a_file_store_read_only_leaves_access_times_alone(tmp_path):
    file_store(tmp_path / "files")
    key = bytes([1]) * 32
    with FileBackend(tmp_path / "files") as b:
        before = b.entry_meta(key)["last_access_ns"]
    with open_read_only(f"file://{tmp_path / 'files'}") as tool:
        assert tool.get_many([key]) == [bytes([1]) * 100]
        assert tool.entry_meta(key)["last_access_ns"] == before


def test_the_host_tier_cannot_be_opened_by_tools():
    with pytest.raises(ConfigError, match="host:// lives inside a serving process"):
        open_read_only("host://?capacity=1MiB")


def test_redis_opened_read_only_reads_with_the_tools_timeout_and_no_retries(redis_url):
    with open_backend(redis_url) as b:
        b.put_many([(b"k", b"v")])
    with open_read_only(redis_url, timeout=0.75) as tool:
        assert tool.get_many([b"k"]) == [b"v"]
        assert tool.timeout == 0.75


def test_redis_that_is_away_is_unavailable_not_a_hang():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open_read_only(f"redis://127.0.0.1:{port}/0", timeout=0.5) as tool:
        with pytest.raises(BackendUnavailable):
            tool.contains_many([b"k"])
