"""Blocks of the LMDB tier kept in segment files, as the store sees them: raw blocks of 64 KiB
and more land in segments and load straight into the caller's blocks (their payload read into
the destination, checked there); a flipped byte in a segment file is a counted corrupt miss
that leaves nothing of the block in the destination and removes the entry; a block whose
segment file is gone or cut short is no corrupt block. Real stores on tmp_path, nothing mocked."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.store.helpers import NS, keys_for, load, make_store, payloads
from tiered_kv.keys import Namespace
from tiered_kv.store.codec_header import HEADER_BYTES

NS64 = Namespace(model_id="test-llama", dtype="bfloat16", num_layers=16, num_kv_heads=2,
                 head_dim=32, block_size=16)  # 64 KiB blocks: one frame
NS256 = Namespace(model_id="test-llama", dtype="bfloat16", num_layers=64, num_kv_heads=2,
                  head_dim=32, block_size=16)  # 256 KiB blocks: four layer groups, a segment table
TINY = Namespace(model_id="test-llama", dtype="bfloat16", num_layers=2, num_kv_heads=2,
                 head_dim=16, block_size=16)  # 4 KiB blocks


def disk_store(tmp_path, ns: Namespace):
    return make_store(tmp_path, ns=ns, host="2MiB", disk={"codec": "raw"})


def place_of(store, key: bytes):
    """Where the disk tier keeps ``key``'s block in a segment file (None: in LMDB's pages)."""
    tier = store.tier("disk")
    with tier.backend.env.begin() as txn:
        return tier.backend.values.place_of(txn, tier.ns + key)


def head_lengths(store, keys: list[bytes]) -> list[int | None]:
    """How the disk tier's medium splits each block read into a block-sized destination: the
    length of the head handed over first (None: the block is visited whole)."""
    tier = store.tier("disk")
    heads: list[int | None] = [None] * len(keys)

    def visitor(i, head, whole):
        heads[i] = None if head is None else len(head)

    outs = [bytearray(store.block_nbytes) for _ in keys]
    assert tier.backend.visit_split([tier.ns + k for k in keys], outs, visitor) == [True] * len(keys)
    return heads


@pytest.mark.parametrize("ns", [NS64, NS256, NS], ids=["64KiB", "256KiB-framed", "16KiB"])
def test_raw_blocks_of_64_KiB_and_more_live_in_segment_files_and_load_back_bit_exact(tmp_path, ns):
    with disk_store(tmp_path, ns) as store:
        keys = keys_for(6, ns)
        data = payloads(store, 6)
        store.save(keys, data)
        store.flush()
        store.host.delete_many(keys)  # loads come from the disk tier
        large = store.block_nbytes >= 64 << 10
        assert [place_of(store, k) is not None for k in keys] == [large] * 6
        heads = head_lengths(store, keys)
        if ns is NS64:
            assert heads == [HEADER_BYTES] * 6, "the payload goes straight to the destination"
        elif ns is NS256:
            assert all(HEADER_BYTES < h <= 64 << 10 for h in heads), "header and segment table ahead"
        else:
            assert heads == [None] * 6, "a block in LMDB's pages is visited whole"
        outs = [torch.full(store.shape, 3.0, dtype=store.dtype) for _ in keys]
        assert store.load_into(keys, outs) == [True] * 6
        assert all(torch.equal(o, d) for o, d in zip(outs, data))
        assert store.metrics.misses("corrupt") == 0
        assert store.tier("disk").backend.check() == []


@pytest.mark.parametrize("ns", [NS64, NS256], ids=["64KiB", "256KiB-framed"])
@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_flipped_byte_in_a_segment_file_is_a_corrupt_miss_that_leaves_nothing_in_the_destination(
        tmp_path, ns, where):
    with disk_store(tmp_path, ns) as store:
        keys, data = keys_for(4, ns), payloads(store, 4)
        store.save(keys, data)
        store.flush()
        store.host.delete_many(keys)
        backend = store.tier("disk").backend
        place = place_of(store, keys[1])
        at = place.offset + (place.length - 1000 if where == "payload" else 40)
        with open(backend.values.files.path_of(place.segment), "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x10]))
        outs = [torch.full(store.shape, 3.0, dtype=store.dtype) for _ in keys]
        assert store.load_into(keys, outs) == [True, False, True, True]
        assert not outs[1].any(), "a byte of the bad block stayed in the destination"
        assert all(torch.equal(outs[i], data[i]) for i in (0, 2, 3))
        assert store.metrics.misses("corrupt") == 1
        assert store.tier("disk").contains([keys[1]]) == [False], "a corrupt block is removed once found"
        assert place_of(store, keys[1]) is None and backend.check() == []
        ok, again = load(store, keys)
        assert ok == [True, False, True, True] and store.metrics.misses("corrupt") == 1


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_a_block_whose_segment_file_is_gone_or_cut_short_is_a_miss_but_no_corrupt_block(tmp_path, damage):
    with disk_store(tmp_path, NS64) as store:
        keys, data = keys_for(3, NS64), payloads(store, 3)
        store.save(keys, data)
        store.flush()
        store.host.delete_many(keys)
        places = [place_of(store, k) for k in keys]  # (the pool's writers may use a segment each)
        segment = places[0].segment
        path = store.tier("disk").backend.values.files.path_of(segment)
    last = max((p for p in places if p.segment == segment), key=lambda p: p.offset)
    if damage == "deleted":
        os.unlink(path)
    else:  # the block written last to that segment is cut in half
        os.truncate(path, last.offset + last.length // 2)
    with disk_store(tmp_path, NS64) as store:
        ok, outs = load(store, keys)
        assert ok == [p.segment != segment or (damage == "truncated" and p != last) for p in places]
        assert all(torch.equal(o, d) for o, d, good in zip(outs, data, ok) if good)
        assert store.metrics.misses("corrupt") == 0, "nothing failed a check: the medium did not have it"


def test_a_compressed_block_a_few_bytes_longer_than_its_payload_loads_and_is_not_removed_as_corrupt(tmp_path):
    """A value in a segment file is read split when it is 1 B..64 KiB longer than the caller's
    block: a zstd block whose compressing saved fewer bytes than its header takes was split
    with a head shorter than a header, refused as a "truncated header": a good block a corrupt
    miss, and removed from its tier. Such a block is read whole."""
    disk = {"codec": "zstd+shuffle", "options": {"segment_min": "1KiB"}}  # every block in a segment
    with make_store(tmp_path, ns=TINY, disk=disk) as store:
        keys = keys_for(3, TINY)
        words = np.random.default_rng(5).integers(0, 1 << 16, (3, 2048), dtype=np.uint16)
        words[:, :80] &= 0x00FF  # a high byte plane just compressible enough to be stored compressed
        data = [torch.from_numpy(w.copy()).view(torch.bfloat16).reshape(store.shape) for w in words]
        store.save(keys, data)
        store.flush()
        store.host.delete_many(keys)
        heads = head_lengths(store, keys)
        assert all(h is not None and 0 < h < HEADER_BYTES for h in heads), f"(the scenario) {heads}"
        outs = [torch.full(store.shape, 3.0, dtype=store.dtype) for _ in keys]
        assert store.load_into(keys, outs) == [True] * 3
        assert all(torch.equal(o.view(torch.int16), d.view(torch.int16)) for o, d in zip(outs, data))  # (NaNs)
        assert store.metrics.misses("corrupt") == 0
        assert store.tier("disk").contains(keys) == [True] * 3, "a good block was removed as corrupt"
