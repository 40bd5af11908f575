"""Lies a structure-aware fuzzer found past every check (each forged with its checksums made to
match): a block padded past any size its layout is stored in (a zstd skippable frame after the
payload's frame decodes fine) was a hit, read and copied whole, and cost a layer-wise read a
buffer of its size; a namespace record nested deeper than the JSON parser goes raised
RecursionError out of its readers (a salted namespace's saves failed on it, blocks silently
unsaved); a header whose created time is no time (NaN, infinite) made ``tiered-kv show`` fail
with a traceback."""

from __future__ import annotations

import struct
import sys

import numpy as np
import pytest
import torch
import xxhash

from tests.cli.conftest import cli
from tests.store.helpers import keys_for, load, load_staged, make_store, payloads
from tiered_kv.errors import CorruptBlock
from tiered_kv.keys import Namespace
from tiered_kv.store.codec import HEADER, HEADER_BYTES, BlockCodec, BlockLayout
from tiered_kv.store.codec_segments import ENTRY, TABLE_HEAD, table_len
from tiered_kv.store.cost_records import decode_costs
from tiered_kv.store.host_slots import bytes_of
from tiered_kv.store.records import decode_namespace, encode_namespace, namespace_key, scrubbed
from tiered_kv.store.tenant_cipher import TenantCipher

# 8 layers of 32 KiB: framed in 4 layer groups of 64 KiB (layer_groups 8), or one (layer_groups 1)
WIDE = Namespace(model_id="test-llama", dtype="bfloat16", num_layers=8, num_kv_heads=4, head_dim=32,
                 block_size=64)
SALTED = Namespace(model_id="test-llama", dtype="bfloat16", num_layers=4, num_kv_heads=2, head_dim=32,
                   block_size=16, cache_salt="tenant-a")
PAD = 4 << 20  # the skippable frame's content: 16x the block


def skippable(n: int) -> bytes:
    """A zstd skippable frame of ``n`` content bytes (a decompressor passes over it)."""
    return struct.pack("<II", 0x184D2A50, n) + bytes(n)


def rehashed(fields: list, body: bytes) -> bytes:
    head = HEADER.pack(*fields)
    return head[:-4] + struct.pack("<I", xxhash.xxh32_intdigest(head[:-4])) + body


def padded(blob: bytes) -> bytes:
    """``blob`` (a zstd block) with a skippable frame after its last zstd frame, every length,
    table entry and checksum made to match."""
    fields, body = list(HEADER.unpack_from(blob)), bytes(blob[HEADER_BYTES:])
    if not fields[6]:  # unsegmented: body check over the whole body
        body += skippable(PAD)
        fields[16], fields[18] = len(body), xxhash.xxh3_64_intdigest(body) & 0xFFFFFFFF
        return rehashed(fields, body)
    (n,) = TABLE_HEAD.unpack_from(body)
    entries = [list(e) for e in ENTRY.iter_unpack(body[TABLE_HEAD.size : table_len(n)])]
    rest, last = body[table_len(n):] + skippable(PAD), entries[-1]
    assert last[4] != 0, "the last segment is compressed"
    last[1] += len(skippable(PAD))
    last[3] = xxhash.xxh3_64_intdigest(rest[len(rest) - last[1]:]) & 0xFFFFFFFF
    table = TABLE_HEAD.pack(n) + b"".join(ENTRY.pack(*e) for e in entries)
    fields[16], fields[17], fields[18] = (len(table) + len(rest), xxhash.xxh3_64_intdigest(table),
                                          xxhash.xxh32_intdigest(table))
    return rehashed(fields, table + rest)


def load_layered(store, keys):
    plan = store.loader.load(store.prepare_load(keys), layered=True)
    try:
        plan.wait(30)
        return plan.ok, [store.slot_tensor(s).clone() if s is not None else None for s in plan.slots]
    finally:
        store.release(plan)


@pytest.mark.parametrize("loader", [load, load_staged, load_layered], ids=["direct", "staged", "layered"])
@pytest.mark.parametrize("groups", [1, 8], ids=["one_frame", "layer_groups"])
def test_a_block_padded_past_any_size_its_layout_is_stored_in_is_a_counted_corrupt_miss(tmp_path, groups, loader):
    keys = keys_for(3, ns=WIDE)
    with make_store(tmp_path, ns=WIDE, host="4MiB", disk={"codec": "zstd", "capacity": "256MiB"},
                    layer_groups=groups) as store:
        tier = store.tier("disk")
        data = payloads(store, 3)
        blobs = [bytes(tier.encode(k, bytes_of(p))) for k, p in zip(keys, data)]
        blobs[1] = padded(blobs[1])
        assert tier.backend.put_many([(tier.ns + k, b) for k, b in zip(keys, blobs)]) == [True] * 3
        ok, outs = loader(store, keys)
        assert ok == [True, False, True], "a block stored in more bytes than its layout ever takes is a miss"
        assert torch.equal(outs[0], data[0]) and torch.equal(outs[2], data[2])
        assert store.metrics.tiers["disk"].misses["corrupt"] == 1
        assert tier.contains(keys) == [True, False, True], "the padded entry is removed from its tier"
        # refused from its header alone, before a byte of its body is read or a buffer made for it
        with pytest.raises(CorruptBlock, match="stored bytes"):
            BlockCodec.head_length(blobs[1][:HEADER_BYTES], total_len=len(blobs[1]), namespace=tier.ns,
                                   key=keys[1], expect=tier.layout)


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
@pytest.mark.parametrize("segments", [None, [1 << 14] * 16], ids=["one_frame", "sixteen_frames"])
def test_the_largest_blocks_a_layout_is_stored_in_still_decode(sealed, segments):
    """Incompressible payloads (every frame raw), framed and sealed: the most bytes honest
    blocks take stay within the bound."""
    shape, layout = (16, 2, 16, 4, 64), BlockLayout("bfloat16", (16, 2, 16, 4, 64))
    raw = np.random.default_rng(3).integers(0, 256, layout.raw_len, dtype=np.uint8).tobytes()
    blob = BlockCodec("zstd").encode(raw, dtype="bfloat16", shape=shape, namespace=b"N" * 16, key=b"K" * 16,
                                     segments=segments)
    sealing = TenantCipher(b"a secret of enough bytes").sealing(b"alice") if sealed else None
    if sealed:
        blob = BlockCodec.seal(blob, sealing, expect=layout)
    _, got = BlockCodec().decode(blob, namespace=b"N" * 16, key=b"K" * 16, expect=layout, sealing=sealing)
    assert bytes(got) == raw


def nested(depth: int, member: str = "x", doc: bytes = b"{}") -> bytes:
    """``doc`` (a JSON object) with a member nested ``depth`` lists deep."""
    inner = f'"{member}":' + "[" * depth + "]" * depth
    return doc[:-1] + (b"," if doc != b"{}" else b"") + inner.encode() + b"}"


@pytest.mark.parametrize("namespace", [WIDE, SALTED], ids=["plain", "salted"])
def test_a_namespace_record_nested_past_the_json_parsers_depth_is_unreadable_not_a_recursion_error(namespace):
    key, good = namespace_key(namespace.digest()), encode_namespace(namespace)
    limit = sys.getrecursionlimit()
    values = [b"[" * 100_000, b'{"a":' * 100_000]  # past the parser's limit
    values += [nested(d, m, good) for d in range(limit - 60, limit + 10) for m in ("x", "restore_costs")]
    for value in values:  # (just under the limit, the seal's json.dumps raised it)
        for read in (decode_namespace, scrubbed, lambda k, v: decode_costs(v)):
            try:
                read(key, value)
            except CorruptBlock:
                pass


def test_a_deeply_nested_namespace_record_does_not_fail_the_saves_of_a_salted_namespace(tmp_path):
    keys = keys_for(4, ns=SALTED)
    with make_store(tmp_path, ns=SALTED) as store:
        tier = store.tier("disk")
        assert tier.backend.put_many([(namespace_key(tier.ns), b"[" * 100_000)]) == [True]
        saved = store.save(keys, payloads(store, 4))
        assert store.flush(30)
        assert saved.exception(timeout=30) is None, "the record's error fails the save"
        assert tier.contains(keys) == [True] * 4, "every block is stored all the same"


@pytest.mark.parametrize("created", [float("nan"), float("inf"), 1e300], ids=["nan", "inf", "huge"])
def test_show_reports_a_block_whose_created_time_is_no_time_without_a_traceback(tmp_path, created):
    url = f"file://{tmp_path}/files"
    with make_store(tmp_path, disk={"url": url}) as store:
        tier, key = store.tier("disk"), keys_for(1)[0]
        blob = bytes(tier.encode(key, bytes_of(payloads(store, 1)[0])))
        fields = list(HEADER.unpack_from(blob))
        fields[19] = created  # (the codec checks no created time: the payload is good)
        assert tier.backend.put_many([(tier.ns + key, rehashed(fields, blob[HEADER_BYTES:]))]) == [True]
    shown = cli("show", url, (tier.ns + key).hex(), "--json")
    assert shown.code == 0, shown.err
    assert "Traceback" not in shown.err
