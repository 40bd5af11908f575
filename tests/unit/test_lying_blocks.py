"""Stored blocks whose headers lie: the header's own checksum is valid and its fields agree with
each other (shape x dtype = raw length, stored length = body length, body and payload checks
right for the body), but they describe another shape, dtype, size or codec than the namespace's
block. The codec refuses them before allocating or decompressing anything, and a tier turns them
(and any other decode failure) into a counted ``corrupt`` miss and removes them."""

from __future__ import annotations

import logging
import struct
import tracemalloc
from collections.abc import Iterator, Sequence
from math import prod

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from storage_backends.base import Backend, BackendStats
from tiered_kv.config import DiskConfig
from tiered_kv.dtypes import ITEMSIZE
from tiered_kv.errors import CorruptBlock
from tiered_kv.keys import Namespace
from tiered_kv.store.codec import (
    CODECS,
    DTYPE_CODES,
    HEADER,
    MAGIC,
    MAX_NDIM,
    VERSION,
    ZSTD_MAX_RATIO,
    BlockCodec,
    BlockLayout,
)
from tiered_kv.store.encoded_tier import EncodedTier
from tiered_kv.store.metrics import StoreMetrics

NS_FIELDS = Namespace(model_id="lying-test", dtype="bfloat16", num_layers=2, num_kv_heads=2,
                      head_dim=8, block_size=4)
NS = NS_FIELDS.digest()
KEY = b"K" * 16
SHAPE = (2, 2, 4, 2, 8)  # the namespace's block: 256 bfloat16 = 512 bytes
EXPECT = BlockLayout("bfloat16", SHAPE)
TIB = 1 << 40
SMALL_PEAK = 256 << 10  # what a refused block may cost to look at, at most


# -- forging blocks ------------------------------------------------------------------------------
def body_check(body: bytes) -> int:
    return xxhash.xxh3_64_intdigest(body) & 0xFFFFFFFF


def forge(body: bytes, *, codec: str, dtype: str, shape: Sequence[int], raw_len: int | None = None,
          checksum: int = 0, namespace: bytes = NS, key: bytes = KEY) -> bytes:
    """A block with ``body`` and a header that says whatever it is told, with a valid header
    check (the header's own checksum cannot tell a liar from an honest block)."""
    size = ITEMSIZE[dtype]
    raw_len = prod(shape) * size if raw_len is None else raw_len
    dims = tuple(shape) + (0,) * (MAX_NDIM - len(shape))
    head = HEADER.pack(MAGIC, VERSION, CODECS[codec], DTYPE_CODES[dtype], 1, len(shape), 0, *dims,
                       namespace, key, raw_len, len(body), checksum, body_check(body), 0.0, 0)
    return head[:-4] + struct.pack("<I", xxhash.xxh32_intdigest(head[:-4])) + body


def zstd_frame_declaring(content_size: int) -> bytes:
    """A zstd frame header declaring ``content_size`` bytes (single segment: the window is the
    content size), followed by one RLE block."""
    head = struct.pack("<IB", 0xFD2FB528, 0xE0) + struct.pack("<Q", content_size)
    return head + struct.pack("<I", 1 | (1 << 1) | (4 << 3))[:3] + b"\x00"


def honest(dtype: str, shape: Sequence[int], codec: str, seed: int = 0) -> bytes:
    """A block BlockCodec really writes, for ``dtype`` x ``shape``, under our namespace and key."""
    n = prod(shape) * ITEMSIZE[dtype]
    rng = np.random.default_rng(seed)
    payload = (rng.integers(0, 4, n, dtype=np.uint8) if seed % 2 else rng.integers(0, 256, n, dtype=np.uint8))
    return BlockCodec(codec).encode(payload, dtype=dtype, shape=tuple(shape), namespace=NS, key=KEY)


def peak_of(fn) -> tuple[BaseException | None, int]:
    """(what ``fn()`` raised, the peak of Python-tracked memory it allocated)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        try:
            fn()
            raised = None
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            raised = exc
        return raised, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


# -- layouts a liar can claim ----------------------------------------------------------------------
def _factorizations(n: int, dims: int) -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes of ``dims`` dimensions holding exactly ``n`` items."""
    if dims == 1:
        return st.just((n,))
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return st.sampled_from(divisors).flatmap(
        lambda d: _factorizations(n // d, dims - 1).map(lambda rest: (d, *rest)))


same_size_layouts = st.sampled_from(sorted(DTYPE_CODES)).flatmap(
    lambda dtype: st.integers(1, MAX_NDIM).flatmap(
        lambda dims: _factorizations(EXPECT.raw_len // ITEMSIZE[dtype], dims).map(
            lambda shape: (dtype, shape))))
any_layouts = st.tuples(st.sampled_from(sorted(DTYPE_CODES)),
                        st.lists(st.integers(1, 9), min_size=1, max_size=MAX_NDIM).map(tuple))
other_layouts = st.one_of(same_size_layouts, any_layouts).filter(lambda lay: lay != (EXPECT.dtype, SHAPE))


# -- the codec ----------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=other_layouts, codec=st.sampled_from(sorted(CODECS)), seed=st.integers(0, 3))
def test_block_encoded_for_another_layout_is_corrupt_before_touching_the_out_buffer(layout, codec, seed):
    dtype, shape = layout
    mine = honest(EXPECT.dtype, SHAPE, codec, seed)
    assert BlockCodec().decode(mine, namespace=NS, key=KEY, expect=EXPECT)[0].shape == SHAPE
    blob = honest(dtype, shape, codec, seed)
    assert BlockCodec().decode(blob, namespace=NS, key=KEY)[0].shape == shape  # honest on its own
    out = bytearray(b"\xa5" * EXPECT.raw_len)
    with pytest.raises(CorruptBlock) as info:
        BlockCodec().decode(blob, namespace=NS, key=KEY, out=out, expect=EXPECT)
    assert info.value.reason == "corrupt"
    assert out == b"\xa5" * EXPECT.raw_len, "nothing of a lying block is written anywhere"
    assert "\n" not in info.value.detail and len(info.value.detail) < 300


@pytest.mark.parametrize("padded", [False, True], ids=["17_byte_body", "32MiB_body"])
@pytest.mark.parametrize("with_layout", [True, False], ids=["namespace_known", "no_namespace_record"])
def test_zstd_frame_declaring_one_tebibyte_is_refused_before_allocating(with_layout, padded):
    frame = zstd_frame_declaring(TIB)
    # padded: a body long enough that a zstd frame in it could really expand to 1 TiB
    body = frame + bytes(TIB // ZSTD_MAX_RATIO) if padded else frame
    blob = forge(body, codec="zstd", dtype="uint8", shape=(1 << 20, 1 << 20))
    fields = HEADER.unpack(blob[: HEADER.size])
    assert fields[-6] == TIB and xxhash.xxh32_intdigest(blob[: HEADER.size - 4]) == fields[-1]
    raised, peak = peak_of(lambda: BlockCodec().decode(
        blob, namespace=NS, key=KEY, expect=EXPECT if with_layout else None))
    assert isinstance(raised, CorruptBlock), repr(raised)
    assert raised.reason == "corrupt" and peak < SMALL_PEAK


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_shuffled_block_declaring_one_tebibyte_is_refused_before_allocating(dtype):
    size = ITEMSIZE[dtype]
    frame = zstd_frame_declaring(TIB // size * (size - 1))
    body = struct.pack("<Q", len(frame)) + frame + b"\x00" * 64
    blob = forge(body, codec="zstd+shuffle", dtype=dtype, shape=(1 << 20, (1 << 20) // size))
    raised, peak = peak_of(lambda: BlockCodec().decode(blob, namespace=NS, key=KEY))
    assert isinstance(raised, CorruptBlock), repr(raised)
    assert peak < SMALL_PEAK


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(codec=st.sampled_from(sorted(CODECS)), dtype=st.sampled_from(sorted(DTYPE_CODES)),
       shape=st.lists(st.integers(1, (1 << 32) - 1), min_size=1, max_size=MAX_NDIM).map(tuple),
       body=st.binary(min_size=0, max_size=96), frame_size=st.one_of(st.none(), st.integers(0, 1 << 62)))
def test_self_consistent_forged_headers_are_corrupt_blocks_within_bounded_memory(codec, dtype, shape, body,
                                                                                 frame_size):
    raw_len = prod(shape) * ITEMSIZE[dtype]
    assume(raw_len < 1 << 64)
    if codec == "raw":
        assume(raw_len <= 4096)
        body = bytes(raw_len)  # stored length = raw length, as for an honest raw block
    elif frame_size is not None:  # a real frame header declaring a size (not always raw_len)
        frame = zstd_frame_declaring(frame_size if frame_size % 3 else raw_len)
        body = struct.pack("<Q", len(frame)) + frame + body if codec == "zstd+shuffle" else frame + body
    blob = forge(body, codec=codec, dtype=dtype, shape=shape, checksum=12345)
    raised, peak = peak_of(lambda: BlockCodec().decode(blob, namespace=NS, key=KEY))
    assert isinstance(raised, CorruptBlock), repr(raised)
    allowed = SMALL_PEAK + 2 * len(blob)
    if codec == "zstd":  # a frame could really expand this much: only decompressing tells
        allowed += min(raw_len, ZSTD_MAX_RATIO * len(body))
    assert peak < allowed


# -- the tier ------------------------------------------------------------------------------------
class DictBackend(Backend):
    """A medium in a dict: enough for EncodedTier."""

    name = "dict"

    def __init__(self) -> None:
        super().__init__("dict://")
        self.values: dict[bytes, bytes] = {}

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [self.values.get(k) for k in keys]

    def put_many(self, items, tenant: bytes = b"") -> list[bool]:
        self.values.update((k, bytes(v)) for k, v in items)
        return [True] * len(items)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self.values for k in keys]

    def delete_many(self, keys: Sequence[bytes]) -> int:
        return sum(self.values.pop(k, None) is not None for k in keys)

    def scan(self, prefix: bytes = b"") -> Iterator[bytes]:
        return iter([k for k in self.values if k.startswith(prefix)])

    def stats(self) -> BackendStats:
        return self._snapshot(entries=len(self.values))

    def close(self) -> None:
        pass


def make_tier() -> EncodedTier:
    return EncodedTier(DiskConfig(codec="zstd+shuffle"), DictBackend(), NS_FIELDS, StoreMetrics())


def read(tier: EncodedTier, keys: list[bytes]) -> tuple[list[str | None], list[bytearray]]:
    outs = [bytearray(b"\xa5" * EXPECT.raw_len) for _ in keys]
    reasons, _ = tier.read_into(keys, [np.frombuffer(o, dtype=np.uint8) for o in outs])
    return reasons, outs


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=other_layouts, codec=st.sampled_from(sorted(CODECS)), seed=st.integers(0, 3))
def test_a_tier_counts_a_block_of_another_layout_as_corrupt_and_removes_it(layout, codec, seed):
    tier = make_tier()
    good = [bytes([i]) * 16 for i in (1, 3)]
    for k in good:
        tier.put_blobs([(k, tier.encode(k, bytes(range(256)) * 2))], EXPECT.raw_len)
    blob = BlockCodec(codec).encode(np.full(prod(layout[1]) * ITEMSIZE[layout[0]], 7, np.uint8),
                                    dtype=layout[0], shape=layout[1], namespace=NS, key=KEY)
    tier.backend.put_many([(tier.ns + KEY, blob)])
    reasons, outs = read(tier, [good[0], KEY, good[1]])
    assert reasons == [None, "corrupt", None]
    assert outs[1] == b"\xa5" * EXPECT.raw_len
    assert outs[0] == bytes(range(256)) * 2 == outs[2]
    assert tier.metrics.misses("corrupt") == 1 and tier.metrics.tiers["disk"].hits == 2
    assert tier.contains([KEY]) == [False], "the lying entry is removed from the tier that served it"


def test_a_tier_refuses_a_block_declaring_one_tebibyte_as_a_corrupt_miss():
    tier = make_tier()
    tier.backend.put_many([(tier.ns + KEY, forge(zstd_frame_declaring(TIB), codec="zstd",
                                                         dtype="uint8", shape=(1 << 20, 1 << 20)))])
    reasons, _ = read(tier, [KEY])
    assert reasons == ["corrupt"] and tier.contains([KEY]) == [False]


@pytest.mark.parametrize("error", [ValueError("bad"), struct.error("unpack"), MemoryError(),
                                   OverflowError("too big"), IndexError("planes"), RuntimeError("zstd?")])
def test_any_exception_while_decoding_a_block_is_a_counted_corrupt_miss(error, monkeypatch, caplog):
    tier = make_tier()
    other = b"O" * 16
    for k in (KEY, other):
        tier.put_blobs([(k, tier.encode(k, bytes(512)))], EXPECT.raw_len)
    real = tier.codec.decode

    def decode(blob, *, key, **kw):
        if key == KEY:
            raise error
        return real(blob, key=key, **kw)

    monkeypatch.setattr(tier.codec, "decode", decode)
    with caplog.at_level(logging.WARNING, logger="tiered_kv.store.encoded_tier"):
        reasons, _ = read(tier, [KEY, other])
    assert reasons == ["corrupt", None], "the next block of the batch is still read"
    assert tier.metrics.misses("corrupt") == 1
    assert tier.contains([KEY, other]) == [False, True]
    [record] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    line = record.getMessage()
    assert KEY.hex() in line and "\n" not in line and len(line) < 400 and record.exc_info is None
