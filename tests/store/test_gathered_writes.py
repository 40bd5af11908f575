"""Raw blocks written from where their payload lies: the write-behind hands the LMDB tier a
block's head and the host slot's bytes (:class:`storage_backends.gathered.Gathered`), written
with one ``pwritev``, instead of first copying the payload next to its head. The stored bytes
must be exactly what the one-buffer path writes, every path that cannot take parts (LMDB's
pages, encryption, compressed codecs, direct I/O staging) must get the joined bytes, and a
short gathered write must continue where it stopped. The Redis tier sends the same parts as
one bulk string. Real LMDB files under tmp_path, a real redis-server."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from storage_backends import segment_io
from storage_backends.gathered import Gathered
from storage_backends.lmdb_disk import LmdbBackend
from tests.store.helpers import keys_for, load, make_store, payloads
from tests.store.test_codec_segments import encode, kv_bytes, plan
from tiered_kv.keys import Namespace

BIG = Namespace(model_id="test-llama-big", dtype="bfloat16", num_layers=8, num_kv_heads=4,
                head_dim=64, block_size=16)  # 128 KiB blocks: past segment_min, in segment files


def address(view) -> int:
    return np.frombuffer(view, np.uint8).ctypes.data


@pytest.mark.parametrize("segments", ["none", "eight"])
def test_a_raw_block_given_gathered_is_the_bytes_the_one_buffer_encode_writes(segments):
    payload = bytearray(kv_bytes("bfloat16"))
    lengths = plan(segments, len(payload), 2)
    gathered = encode(payload, codec="raw", segments=lengths, gathered=True)
    assert isinstance(gathered, Gathered) and len(gathered.parts) == 2
    assert bytes(gathered) == encode(bytes(payload), codec="raw", segments=lengths)
    assert address(gathered.parts[1]) == address(memoryview(payload))  # the payload itself, no copy
    assert len(gathered) == len(bytes(gathered))


def test_a_compressed_block_asked_gathered_comes_back_as_one_buffer():
    payload = kv_bytes("bfloat16")
    blob = encode(payload, codec="zstd+shuffle", segments=plan("eight", len(payload), 2), gathered=True)
    assert not isinstance(blob, Gathered)


def test_the_store_writes_raw_blocks_gathered_and_they_read_back(tmp_path):
    store = make_store(tmp_path, ns=BIG, host="4MiB", disk={"capacity": "64MiB", "codec": "raw"})
    try:
        assert store.tiers[0].gathers
        blocks = payloads(store, 12)
        keys = keys_for(12, BIG)
        store.save(keys, blocks).result(timeout=30)
        tier = store.tiers[0]
        stored = tier.backend.get_many([tier.ns + k for k in keys])
        for k, b, s in zip(keys, blocks, stored):  # header, table, then the payload as it was
            raw = b.view(torch.uint8).numpy().reshape(-1)
            assert len(s) == tier.stored_max and s[-len(raw):] == raw.tobytes()
            out = np.zeros_like(raw)
            tier.codec.decode(s, namespace=tier.ns, key=k, out=out, expect=tier.layout)
            assert np.array_equal(out, raw)
    finally:
        store.close()
    again = make_store(tmp_path, ns=BIG, host="4MiB", disk={"capacity": "64MiB", "codec": "raw"})
    try:
        ok, outs = load(again, keys)
        assert ok == [True] * 12 and all(torch.equal(a, b) for a, b in zip(outs, blocks))
    finally:
        again.close()


def test_an_encrypted_or_compressed_tier_does_not_gather(tmp_path):
    sealed = make_store(tmp_path / "a", ns=BIG, disk={"codec": "raw"}, encryption_secret="s" * 32)
    zstd = make_store(tmp_path / "b", ns=BIG, disk={"codec": "zstd"})
    try:
        assert not sealed.tiers[0].gathers and not zstd.tiers[0].gathers
    finally:
        sealed.close()
        zstd.close()


def test_a_gathered_value_too_small_for_a_segment_goes_joined_into_lmdbs_pages(tmp_path):
    b = LmdbBackend(tmp_path / "db", capacity=64 << 20)
    value = Gathered((b"head", b"x" * 1000))
    assert b.put_many([(b"small", value)]) == [True]
    assert b.get_many([b"small"]) == [b"head" + b"x" * 1000]
    b.close()


def test_a_short_gathered_write_continues_where_it_stopped(tmp_path, monkeypatch):
    real = os.pwritev
    calls = []

    def short(fd, parts, offset):  # the kernel may write less than asked: at most 1000 bytes
        calls.append(offset)
        head = b"".join(bytes(p) for p in parts)[:1000]
        return real(fd, [head], offset)

    monkeypatch.setattr(segment_io.os, "pwritev", short)
    b = LmdbBackend(tmp_path / "db", capacity=64 << 20)
    value = Gathered((b"H" * 300, os.urandom(100_000)))
    assert b.put_many([(b"k", value)]) == [True]
    assert b.get_many([b"k"]) == [bytes(value)] and len(calls) == 101
    b.close()


def test_the_store_sends_raw_blocks_to_redis_from_the_host_slot_and_they_read_back(redis_url):
    store = make_store(ns=BIG, host="4MiB", disk=None, remote_url=redis_url, remote={"codec": "raw"})
    try:
        tier = store.tiers[0]
        assert tier.name == "remote" and tier.gathers
        blocks = payloads(store, 12)
        keys = keys_for(12, BIG)
        store.save(keys, blocks).result(timeout=30)
        for k, b, s in zip(keys, blocks, tier.backend.get_many([tier.ns + k for k in keys])):
            raw = b.view(torch.uint8).numpy().reshape(-1)
            assert s[-len(raw):] == raw.tobytes()
            out = np.zeros_like(raw)
            tier.codec.decode(s, namespace=tier.ns, key=k, out=out, expect=tier.layout)
            assert np.array_equal(out, raw)
    finally:
        store.close()
    again = make_store(ns=BIG, host="4MiB", disk=None, remote_url=redis_url, remote={"codec": "raw"})
    try:
        ok, outs = load(again, keys)
        assert ok == [True] * 12 and all(torch.equal(a, b) for a, b in zip(outs, blocks))
    finally:
        again.close()
