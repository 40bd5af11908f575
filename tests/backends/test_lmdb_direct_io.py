"""The LMDB tier with ``direct_io``: segment values written with O_DIRECT from aligned staging
buffers, each on its own 4 KiB pages, read back the same by every read path and by a store that
writes through the page cache."""

from __future__ import annotations

import logging
import os

import torch

from storage_backends import segment_io
from storage_backends.lmdb_disk import LmdbBackend
from storage_backends.lmdb_segments import unpack_place
from storage_backends.segment_io import ALIGN

KiB, MiB = 1 << 10, 1 << 20


def blob(i: int, n: int) -> bytes:
    return bytes((i * 31 + j) % 251 for j in range(256)) * (n // 256) + bytes(n % 256)


def places(b: LmdbBackend, keys: list[bytes]):
    with b._db.env.begin() as txn:
        return [unpack_place(txn.get(k, db=b._db.tables.places)) for k in keys]


def test_direct_values_start_on_their_own_pages_and_every_read_path_returns_their_bytes(direct_dir):
    sizes = [100 * KiB + 1, 64 * KiB, 2 * MiB + 344, 70_000]  # odd lengths get a zero pad
    expected = {b"k%d" % i: blob(i, n) for i, n in enumerate(sizes)}
    keys = list(expected)
    b = LmdbBackend(direct_dir, capacity=64 * MiB, direct_io=True)
    assert b.values.files.writer.direct is not None
    assert b.put_many(list(expected.items())) == [True] * len(keys)
    found = places(b, keys)
    assert all(p.offset % ALIGN == 0 for p in found)
    assert [p.length for p in found] == sizes  # the place keeps the value's own length
    assert b.get_many(keys) == [expected[k] for k in keys]
    seen: dict[int, bytes] = {}
    assert b.visit_many(keys, lambda i, v: seen.__setitem__(i, bytes(v))) == [True] * len(keys)
    assert [seen[i] for i in range(len(keys))] == [expected[k] for k in keys]
    whole: list[bytes] = []

    def read_all(sizes, reader):
        for i, size in enumerate(sizes):
            into = bytearray(size)
            assert reader.read(i, 0, into) is True
            whole.append(bytes(into))

    assert b.visit_ranges(keys, read_all) == [True] * len(keys)
    assert whole == [expected[k] for k in keys]
    stats = b.stats().extra
    assert stats["segment_bytes"] == sum(-(-n // ALIGN) * ALIGN for n in sizes)
    pads = [-(-n // ALIGN) * ALIGN - n for n in sizes]
    assert stats["segment_dead_bytes"] >= sum(pads[:-1])  # the pads count as dead bytes (the last
    assert stats["segment_dead_bytes"] + sum(sizes) <= stats["segment_bytes"]  # once followed)
    assert b.check() == []
    b.close()


def test_a_split_read_of_a_direct_value_lands_its_tail_in_the_callers_tensor(direct_dir):
    value = blob(7, 256 * KiB + 300)
    b = LmdbBackend(direct_dir, capacity=64 * MiB, direct_io=True)
    assert b.put_many([(b"k", value)]) == [True]
    out = torch.zeros(256 * KiB, dtype=torch.uint8).numpy()  # (the store hands a tensor's memory)
    heads: list[bytes] = []
    assert b.visit_split([b"k"], [out], lambda i, head, whole: heads.append(bytes(head)) or True) == [True]
    assert heads == [value[:300]] and bytes(out) == value[300:]
    b.close()


def test_a_store_written_directly_reads_back_through_the_page_cache_and_takes_buffered_writes(direct_dir):
    first = {b"a%d" % i: blob(i, 300 * KiB + i) for i in range(6)}
    b = LmdbBackend(direct_dir, capacity=64 * MiB, segment_bytes=MiB, direct_io=True, sync=True)
    assert b.put_many(list(first.items())) == [True] * 6
    b.close()
    again = LmdbBackend(direct_dir, capacity=64 * MiB, segment_bytes=MiB)  # buffered now
    assert again.get_many(list(first)) == list(first.values())
    second = {b"b%d" % i: blob(i + 50, 90 * KiB + 3 * i) for i in range(4)}
    assert again.put_many(list(second.items())) == [True] * 4
    assert again.get_many(list(first) + list(second)) == list(first.values()) + list(second.values())
    assert again.check() == []
    again.close()


def test_a_file_system_refusing_o_direct_gets_buffered_writes_and_says_so(tmp_path, monkeypatch, caplog):
    real_open = os.open

    def no_direct(path, flags, *args):  # a file system without O_DIRECT answers EINVAL
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(segment_io.os, "open", no_direct)
    with caplog.at_level(logging.WARNING, logger="storage_backends.segment_io"):
        b = LmdbBackend(tmp_path / "db", capacity=64 * MiB, direct_io=True)
    assert b.values.files.writer.direct is None
    assert any("refuses O_DIRECT" in r.getMessage() for r in caplog.records)
    value = blob(3, 100 * KiB + 5)
    assert b.put_many([(b"k", value)]) == [True]
    assert b.get_many([b"k"]) == [value]
    assert places(b, [b"k"])[0].length == len(value)
    assert not any(p.name.startswith(segment_io.PROBE_NAME) for p in (tmp_path / "db" / "segments").iterdir())
    b.close()


def test_direct_io_is_a_url_option(direct_dir):
    from storage_backends.registry import open_backend

    b = open_backend(f"lmdb://{direct_dir}?direct_io=true", capacity=64 * MiB)
    assert b.values.files.writer.direct is not None
    b.close()
