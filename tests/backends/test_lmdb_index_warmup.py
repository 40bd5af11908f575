"""After a restart the LMDB tier reads its index (the meta table) into the page cache in the
background, so the scheduler's first lookups of a long prompt do not read it from disk one
B-tree descent at a time and miss their deadline."""

import storage_backends.lmdb_warmup as warmup
from storage_backends.lmdb_disk import LmdbBackend


def test_a_reopened_lmdb_tier_walks_its_whole_index_in_short_transactions(tmp_path, monkeypatch):
    backend = LmdbBackend(tmp_path, capacity="64MiB")
    backend.put_many([(b"k%04d" % i, b"v" * 64) for i in range(50)])
    backend.close()
    monkeypatch.setattr(warmup, "KEYS_PER_TXN", 7)  # several transactions
    reopened = LmdbBackend(tmp_path, capacity="64MiB")
    try:
        reopened.warmup.thread.join(10)
        assert reopened.warmup.seen == 50
        assert reopened.contains_many([b"k0000", b"k0049", b"nope"]) == [True, True, False]
    finally:
        reopened.close()


def test_a_tool_opening_the_store_read_only_and_an_empty_store_start_no_walk(tmp_path):
    empty = LmdbBackend(tmp_path, capacity="64MiB")
    assert empty.warmup is None
    empty.put_many([(b"k", b"v")])
    empty.close()
    tool = LmdbBackend.open_read_only(f"lmdb://{tmp_path}")
    try:
        assert tool.warmup is None
    finally:
        tool.close()


def test_closing_while_the_index_is_being_walked_stops_the_walk(tmp_path, monkeypatch):
    backend = LmdbBackend(tmp_path, capacity="64MiB")
    backend.put_many([(b"k%04d" % i, b"v") for i in range(200)])
    backend.close()
    monkeypatch.setattr(warmup, "KEYS_PER_TXN", 1)
    reopened = LmdbBackend(tmp_path, capacity="64MiB")
    reopened.close()
    reopened.warmup.thread.join(10)
    assert not reopened.warmup.thread.is_alive()
