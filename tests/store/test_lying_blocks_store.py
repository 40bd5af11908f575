"""Blocks whose self-consistent headers lie (another shape, dtype or size than the namespace's
block, or a zstd frame declaring 1 TiB), served by an LMDB, file:// or Redis tier: a counted
``corrupt`` miss, removed from that tier, and every host slot reserved for it is released, so a
later load of the key answers at once."""

from __future__ import annotations

import contextlib
import struct
from concurrent.futures import wait

import pytest
import torch
import xxhash

from tests.store.helpers import keys_for, load, load_staged, make_store, payloads
from tiered_kv.store import TieredStore, loading
from tiered_kv.store.codec import CODECS, DTYPE_CODES, HEADER, MAGIC, MAX_NDIM, VERSION, BlockCodec
from tiered_kv.store.encoded_tier import EncodedTier
from tiered_kv.store.host_slots import bytes_of

TIB = 1 << 40


def one_tib_block(ns: bytes, key: bytes) -> bytes:
    """uint8 [2^20, 2^20] in zstd, whose frame declares 1 TiB; the header check is valid."""
    frame = struct.pack("<IB", 0xFD2FB528, 0xE0) + struct.pack("<Q", TIB)
    body = frame + struct.pack("<I", 1 | (1 << 1) | (4 << 3))[:3] + b"\x00"
    dims = (1 << 20, 1 << 20) + (0,) * (MAX_NDIM - 2)
    head = HEADER.pack(MAGIC, VERSION, CODECS["zstd"], DTYPE_CODES["uint8"], 1, 2, 0, *dims, ns, key,
                       TIB, len(body), 0, xxhash.xxh3_64_intdigest(body) & 0xFFFFFFFF, 0.0, 0)
    return head[:-4] + struct.pack("<I", xxhash.xxh32_intdigest(head[:-4])) + body


def lying_block(store: TieredStore, tier: EncodedTier, key: bytes, lie: str) -> bytes:
    """A block BlockCodec really encodes, for a layout other than the store's, under ``key``."""
    layers, two, bs, heads, dim = store.shape
    dtype, shape = {
        "fewer_layers": ("bfloat16", (layers // 2, two, bs, heads, dim)),
        "more_layers": ("bfloat16", (layers * 2, two, bs, heads, dim)),
        "same_size_other_shape": ("bfloat16", (layers // 2, two, bs, heads, dim * 2)),
        "other_dtype_same_size": ("float16", store.shape),
        "float32_half_heads": ("float32", (layers, two, bs, heads // 2, dim)),
    }[lie]
    payload = torch.randn(shape).to(getattr(torch, dtype))
    return BlockCodec("zstd+shuffle").encode(bytes_of(payload), dtype=dtype, shape=shape,
                                             namespace=tier.ns, key=key)


LIES = ("fewer_layers", "more_layers", "same_size_other_shape", "other_dtype_same_size",
        "float32_half_heads", "one_tib_zstd_frame")


@pytest.fixture(params=["lmdb", "file", "redis"])
def medium(request, tmp_path):
    """(a store factory, the name of the tier that serves the planted blocks)."""
    if request.param == "redis":
        url = request.getfixturevalue("redis_url")
        return (lambda: make_store(tmp_path, disk=None, remote_url=url)), "remote"
    if request.param == "file":
        return (lambda: make_store(tmp_path, disk={"url": f"file://{tmp_path}/files"})), "disk"
    return (lambda: make_store(tmp_path)), "disk"


def plant(store: TieredStore, tier: EncodedTier, keys: list[bytes], bad: dict[int, str]) -> list[torch.Tensor]:
    """Honest blocks under ``keys`` except at the indexes of ``bad`` (lie kinds), written
    straight into ``tier`` (the host tier stays empty)."""
    data = payloads(store, len(keys))
    for i, (key, payload) in enumerate(zip(keys, data)):
        if i in bad:
            blob = (one_tib_block(tier.ns, key) if bad[i] == "one_tib_zstd_frame"
                    else lying_block(store, tier, key, bad[i]))
            assert tier.backend.put_many([(tier.ns + key, blob)]) == [True]
        else:
            tier.put_blobs([(key, tier.encode(key, bytes_of(payload)))], store.block_nbytes)
    return data


def assert_host_settled(store: TieredStore) -> None:
    stats = store.host.stats()
    assert stats.used_bytes == stats.entries * store.host.slot_bytes, "a host slot is left reserved"
    assert stats.extra["leased"] == 0, "a host slot is left pinned"


@pytest.mark.parametrize("lie", LIES)
def test_block_declaring_another_shape_is_a_counted_corrupt_miss_not_a_valueerror(medium, lie):
    build, where = medium
    keys = keys_for(3)
    with build() as store:
        tier = store.tier(where)
        data = plant(store, tier, keys, {1: lie})
        ok, outs = load(store, keys)
        assert ok == [True, False, True]
        assert torch.equal(outs[0], data[0]) and torch.equal(outs[2], data[2])
        assert not outs[1].any(), "nothing of a lying block reaches the caller"
        assert store.metrics.tiers[where].misses["corrupt"] == 1
        assert tier.contains(keys) == [True, False, True], "the lying entry is removed from its tier"
        assert_host_settled(store)


def test_failed_decode_releases_its_reserved_host_slot(tmp_path):
    keys = keys_for(3)
    with make_store(tmp_path) as store:
        plant(store, store.tier("disk"), keys, {1: "more_layers"})
        plan = store.load(store.prepare_load(keys))
        wait(plan.futures, timeout=30)
        assert [f.exception() for f in plan.futures] == [None] * len(plan.futures), \
            "a bad block never raises out of the load job"
        assert plan.reasons == [None, "corrupt", None] and plan.ok == [True, False, True]
        store.release(plan)
        assert not store.host.reserved(keys[1])
        assert store.host.contains_many(keys) == [True, False, True]
        assert_host_settled(store)


def no_promotion_wait(monkeypatch) -> None:
    """A load finding a key reserved gives up at once (``promotion_timeout``) instead of waiting
    PROMOTION_WAIT_S for a commit: a reservation left behind shows as that miss, not as time."""
    monkeypatch.setattr(loading, "PROMOTION_WAIT_S", 0.0)


def test_a_second_load_of_a_lying_key_returns_at_once_as_a_miss(tmp_path, monkeypatch):
    keys = keys_for(2)
    with make_store(tmp_path) as store:
        plant(store, store.tier("disk"), keys, {0: "one_tib_zstd_frame"})
        with contextlib.suppress(Exception):  # the first load is pinned by the tests above
            load_staged(store, keys)  # (staged: the path that reserves host slots)
        assert not any(store.host.reserved(k) for k in keys), "a reservation nobody will commit"
        no_promotion_wait(monkeypatch)
        plan = store.load(store.prepare_load(keys))
        plan.wait(30)  # (a hang guard only)
        store.release(plan)
        assert plan.reasons[0] in ("corrupt", "absent"), "waited on a reservation nobody will commit"
        assert plan.reasons[1] is None  # (absent: the first load removed the lying entry)
        ok, _ = load(store, keys)
        assert ok == [False, True]
        assert store.metrics.misses("promotion_timeout") == 0
        assert store.metrics.tiers["host"].misses["no_room"] == 0
        assert_host_settled(store)


def test_a_load_job_that_raises_while_reading_aborts_its_reservations(tmp_path, monkeypatch):
    keys = keys_for(2)
    with make_store(tmp_path) as store:
        data = plant(store, store.tier("disk"), keys, {})

        def broken(*args, **kwargs):
            raise RuntimeError("a bug while reading")

        monkeypatch.setattr(store.tier("disk"), "read_into", broken)
        plan = store.load(store.prepare_load(keys))
        wait(plan.futures, timeout=30)
        assert [f.exception() for f in plan.futures] == [None] * len(plan.futures)
        assert plan.ok == [False, False] and all(plan.reasons)
        store.release(plan)
        assert not any(store.host.reserved(k) for k in keys)
        assert_host_settled(store)
        monkeypatch.undo()
        no_promotion_wait(monkeypatch)
        ok, outs = load_staged(store, keys)
        assert ok == [True, True], "waited on a reservation nobody will commit"
        assert all(torch.equal(a, b) for a, b in zip(outs, data))
        ok, outs = load(store, keys)
        assert ok == [True, True] and all(torch.equal(a, b) for a, b in zip(outs, data))
        assert store.metrics.misses("promotion_timeout") == 0


def test_a_lying_block_on_the_remote_is_not_copied_down_to_disk(tmp_path, redis_url):
    keys = keys_for(2)
    with make_store(tmp_path, remote_url=redis_url) as store:
        plant(store, store.tier("remote"), keys, {0: "same_size_other_shape"})
        ok, _ = load(store, keys)
        assert ok == [False, True]
        store.flush()
        assert store.tier("disk").contains(keys) == [False, True]
        assert store.tier("remote").contains(keys) == [False, True]
        assert store.metrics.tiers["remote"].misses["corrupt"] == 1
        assert_host_settled(store)
