"""Whole-block reads of an encrypted LMDB tier whose blocks are large enough to live in segment
files (the medium can read such a value in two pieces, its tail straight into the caller's
buffer): a replica with the secret reads each sealed block once; one that cannot open a block
leaves no byte of it in the caller's buffer. Real LMDB under tmp_path, real store."""

from __future__ import annotations

import pytest
import torch

from tests.store.helpers import keys_for, load, make_store, payloads
from tiered_kv.keys import Namespace
from tiered_kv.store.codec import BlockCodec

SECRET = "correct horse battery staple"
OTHER = "another secret, just as long"
# 128 KiB blocks: over the LMDB tier's segment_min, so each is a value in a segment file
BIG = Namespace(model_id="test-llama-big", dtype="bfloat16", num_layers=16, num_kv_heads=2, head_dim=64,
                block_size=16)
N = 4
RAW = {"codec": "raw"}  # a sealed raw block is just longer than its payload: the medium would split it


def sealed_store(tmp_path):
    """``N`` big blocks saved sealed under SECRET; (keys, payloads)."""
    with make_store(tmp_path, ns=BIG, host="4MiB", disk=RAW, encryption_secret=SECRET) as store:
        keys, data = keys_for(N, BIG), payloads(store, N)
        store.save(keys, data)
        assert store.flush(30)
    return keys, data


def bytes_handed_over(backend, monkeypatch) -> list[int]:
    """A one-item list counting the stored bytes the medium reads for the tier's visitors (a
    split value: its head and the part read into the caller's buffer; else the whole value)."""
    seen = [0]
    split, many = backend.visit_split, backend.visit_many

    def visit_split(keys, outs, visitor):
        def counted(i, head, value):
            seen[0] += len(value) if head is None else len(head) + memoryview(outs[i]).nbytes
            return visitor(i, head, value)
        return split(keys, outs, counted)

    def visit_many(keys, visitor):
        def counted(i, value):
            seen[0] += len(value)
            return visitor(i, value)
        return many(keys, counted)

    monkeypatch.setattr(backend, "visit_split", visit_split)
    monkeypatch.setattr(backend, "visit_many", visit_many)
    return seen


def test_regression_a_sealed_block_was_read_from_disk_twice_per_load(tmp_path, monkeypatch):
    """The tier asked for split reads: the medium read each sealed block's tail into the
    caller's buffer, the tier found it sealed (never laid out as head + payload) and asked for
    the whole block, which the medium read again. A tier that encrypts reads each block once."""
    keys, data = sealed_store(tmp_path)
    with make_store(tmp_path, ns=BIG, host="4MiB", disk=RAW, encryption_secret=SECRET) as store:
        disk = store.tier("disk").backend
        stored = sum(len(v) for v in disk.get_many([store.tier("disk").ns + k for k in keys]))
        seen = bytes_handed_over(disk, monkeypatch)
        ok, outs = load(store, keys)
        assert ok == [True] * N and all(torch.equal(a, b) for a, b in zip(outs, data))
        assert seen[0] == stored


@pytest.mark.parametrize(("secret", "reason"), [(None, "no_key"), (OTHER, "wrong_key")])
def test_regression_a_block_this_replica_cannot_open_left_its_ciphertext_in_the_callers_buffer(
        tmp_path, secret, reason):
    keys, _ = sealed_store(tmp_path)
    with make_store(tmp_path, ns=BIG, host="4MiB", disk=RAW, encryption_secret=secret) as store:
        values = store.tier("disk").backend.get_many([store.tier("disk").ns + k for k in keys])
        assert all(BlockCodec.read_header(v).sealed for v in values)
        ok, outs = load(store, keys)
        assert ok == [False] * N and store.metrics.misses(reason) == N
        assert not any(o.any() for o in outs), "no byte of a block it cannot open"
        assert store.present(keys) == [True] * N  # left for the replicas holding the key


def test_a_sealed_block_gone_before_it_is_read_whole_leaves_no_ciphertext_in_the_callers_buffer(
        tmp_path, monkeypatch):
    """A replica without the secret has a sealed block read in two pieces (its tail straight
    into the caller's buffer), finds it sealed and asks for it whole; a block gone by then (its
    segment no longer holds it: evicted, deleted meanwhile) was an absent miss that left its
    ciphertext in the caller's buffer."""
    keys, _ = sealed_store(tmp_path)
    with make_store(tmp_path, ns=BIG, host="4MiB", disk=RAW) as store:
        values = store.tier("disk").backend.values
        monkeypatch.setattr(values, "read", lambda place, slot=0: None)  # gone since its split read
        ok, outs = load(store, keys)
        assert ok == [False] * N and store.metrics.misses("absent") == N
        assert not any(o.any() for o in outs), "no byte of a block that was not read whole"
