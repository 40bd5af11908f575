"""The stored-block format (tiered_kv.store.codec): round trips, fallbacks and corruption detection."""

from __future__ import annotations

import re
import struct
import threading
import typing

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiered_kv.dtypes import ITEMSIZE
from tiered_kv.errors import ConfigError, CorruptBlock, NamespaceMismatch
from tiered_kv.store.codec import HEADER, HEADER_BYTES, BlockCodec

NS = bytes(range(16))
OTHER_NS = bytes(range(1, 17))
KEY = b"K" * 16
CODECS = ("raw", "zstd", "zstd+shuffle")
TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
# canonical payload layout [num_layers, 2, block_size, num_kv_heads, head_dim]
SHAPE = (4, 2, 16, 4, 64)


def kv_like(dtype: torch.dtype, shape=SHAPE, seed: int = 0) -> torch.Tensor:
    """Gaussian K/V with a per-channel scale (some channels much larger, as in real K caches)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(shape[-2], shape[-1], generator=g)) * 0.5
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def random_bytes(dtype: torch.dtype, shape=SHAPE, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def data_of(kind: str, dtype: torch.dtype) -> torch.Tensor:
    if kind == "kv":
        return kv_like(dtype)
    if kind == "zeros":
        return torch.zeros(SHAPE, dtype=dtype)
    return random_bytes(dtype)


def as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def encode(t: torch.Tensor, codec: str, dtype_name: str, **kw) -> bytes:
    return BlockCodec(codec).encode(as_bytes(t), dtype=dtype_name, shape=tuple(t.shape),
                                    namespace=NS, key=KEY, **kw)


# -- round trips -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["kv", "zeros", "random"])
@pytest.mark.parametrize("dtype_name", sorted(TORCH_DTYPES))
@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_returns_the_exact_payload(codec, dtype_name, kind):
    t = data_of(kind, TORCH_DTYPES[dtype_name])
    blob = encode(t, codec, dtype_name)
    header, payload = BlockCodec().decode(blob, namespace=NS, key=KEY)
    assert bytes(payload) == as_bytes(t).tobytes()
    assert (header.dtype, header.shape, header.namespace, header.key) == (dtype_name, SHAPE, NS, KEY)
    assert header.raw_len == t.numel() * t.element_size()
    assert header.total_len == len(blob) == HEADER_BYTES + header.stored_len
    back = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(t.dtype).reshape(SHAPE)
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))

    one_byte = t.element_size() == 1
    if codec == "raw" or kind == "random":
        # raw stays raw; incompressible bytes fall back to raw instead of growing
        assert header.codec == "raw" and header.stored_len == header.raw_len
    elif kind == "zeros":
        assert header.codec == ("zstd" if one_byte else codec)
        if header.codec == "zstd+shuffle":
            # by design the lowest byte plane is stored raw: what is left is that plane alone
            assert header.stored_len < header.raw_len // t.element_size() + 64
        else:
            assert header.stored_len < header.raw_len // 50
    else:  # KV-like data compresses; 1-byte dtypes have no planes to shuffle
        assert header.codec == ("zstd" if one_byte else codec)
        assert header.stored_len < header.raw_len


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32", "float8_e4m3fn"])
@pytest.mark.parametrize("codec", CODECS)
def test_decode_into_a_caller_buffer_fills_it_in_place(codec, dtype_name):
    t = kv_like(TORCH_DTYPES[dtype_name])
    blob = encode(t, codec, dtype_name)
    slot = torch.full(SHAPE, 3, dtype=t.dtype)  # a host slot with stale content
    out = slot.view(torch.uint8).numpy()
    header, view = BlockCodec().decode(blob, namespace=NS, key=KEY, out=out)
    assert len(view) == header.raw_len
    assert torch.equal(slot.view(torch.uint8), t.view(torch.uint8))


@pytest.mark.parametrize("delta", [-1, 1, -2])
def test_out_buffer_of_the_wrong_size_raises_value_error(delta):
    t = kv_like(torch.bfloat16)
    blob = encode(t, "zstd+shuffle", "bfloat16")
    out = bytearray(t.numel() * 2 + delta)
    with pytest.raises(ValueError, match="output buffer") as info:
        BlockCodec().decode(blob, out=out)
    assert not isinstance(info.value, CorruptBlock)


@pytest.mark.parametrize("dtype_name", ["uint8", "int8", "int32", "float64"])
def test_other_known_dtypes_round_trip_with_shuffle(dtype_name):
    size = ITEMSIZE[dtype_name]
    arr = (np.arange(4096, dtype=np.int64) % 97).astype(f"<i{size}" if "int" in dtype_name else "<f8")
    if dtype_name == "uint8":
        arr = arr.astype(np.uint8)
    blob = BlockCodec("zstd+shuffle").encode(arr, dtype=dtype_name, shape=(64, 64), namespace=NS,
                                             key=KEY)
    header, payload = BlockCodec().decode(blob)
    assert bytes(payload) == arr.tobytes()
    assert header.stored_len < header.raw_len


def test_encode_accepts_a_multi_dimensional_typed_array():
    arr = np.random.default_rng(0).standard_normal((2, 16, 4, 8)).astype(np.float16)
    blob = BlockCodec().encode(arr, dtype="float16", shape=arr.shape, namespace=NS, key=KEY)
    assert bytes(BlockCodec().decode(blob)[1]) == arr.tobytes()


def test_decode_reads_from_a_slice_of_a_larger_buffer():
    blob = encode(kv_like(torch.bfloat16), "zstd+shuffle", "bfloat16")
    big = bytearray(b"x" * 7 + blob + b"y" * 9)
    _, payload = BlockCodec("raw").decode(memoryview(big)[7 : 7 + len(blob)], namespace=NS, key=KEY)
    assert bytes(payload) == as_bytes(kv_like(torch.bfloat16)).tobytes()


def test_created_time_is_stored_and_defaults_to_now(monkeypatch):
    from types import SimpleNamespace

    import tiered_kv.store.codec as codec_module

    t = kv_like(torch.float16)
    assert BlockCodec.read_header(encode(t, "zstd", "float16", created=1234.5)).created == 1234.5
    # "now" is the codec's wall clock, stopped here: no window around this machine's time
    monkeypatch.setattr(codec_module, "time", SimpleNamespace(time=lambda: 1_700_000_000.125))
    assert BlockCodec.read_header(encode(t, "zstd", "float16")).created == 1_700_000_000.125


def test_shuffle_compresses_bf16_kv_better_than_plain_zstd():
    t = kv_like(torch.bfloat16, shape=(8, 2, 16, 8, 128))
    plain = BlockCodec.read_header(encode(t, "zstd", "bfloat16"))
    shuffled = BlockCodec.read_header(encode(t, "zstd+shuffle", "bfloat16"))
    print(f"\nbf16 KV ratio: zstd {plain.ratio:.3f}, zstd+shuffle {shuffled.ratio:.3f}")
    assert shuffled.codec == "zstd+shuffle" and plain.codec == "zstd"
    assert shuffled.ratio > plain.ratio > 1.0


def test_codec_is_safe_to_share_between_threads():
    codec = BlockCodec("zstd+shuffle")
    tensors = [kv_like(torch.bfloat16, shape=(2, 2, 16, 2, 64), seed=s) for s in range(24)]
    errors: list[BaseException] = []

    def work(offset: int) -> None:
        try:
            for i in range(len(tensors)):
                t = tensors[(i + offset) % len(tensors)]
                blob = codec.encode(as_bytes(t), dtype="bfloat16", shape=tuple(t.shape),
                                    namespace=NS, key=KEY)
                assert bytes(codec.decode(blob)[1]) == as_bytes(t).tobytes()
        except BaseException as exc:  # reported by the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k * 5,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors


# -- argument validation -----------------------------------------------------------------------

def test_unknown_codec_or_level_is_a_config_error():
    with pytest.raises(ConfigError, match="codec"):
        BlockCodec("lz4")
    with pytest.raises(ConfigError, match="level"):
        BlockCodec("zstd", level=23)


def test_unknown_dtype_is_a_config_error():
    with pytest.raises(ConfigError, match="dtype"):
        BlockCodec().encode(b"\0" * 8, dtype="complex64", shape=(1,), namespace=NS, key=KEY)


def test_shape_that_does_not_describe_the_payload_raises_value_error():
    with pytest.raises(ValueError, match="shape"):
        BlockCodec().encode(b"\0" * 8, dtype="float16", shape=(2, 3), namespace=NS, key=KEY)


@pytest.mark.parametrize("shape, payload", [
    ((0,), b""),
    ((), b"\0\0"),
    ((-1, -2), b"\0" * 4),
    ((1,) * 7, b"\0\0"),
    ((2**32, 1), b"\0\0"),
])
def test_encode_refuses_shapes_that_decode_would_reject_as_corrupt(shape, payload):
    # regression: encode wrote empty / 0-d / negative shapes, producing blocks that every later
    # read counted as "corrupt" (or died in struct.pack with struct.error)
    with pytest.raises(ValueError):
        BlockCodec().encode(payload, dtype="float16", shape=shape, namespace=NS, key=KEY)


def test_namespace_and_key_must_be_16_bytes():
    with pytest.raises(ValueError, match="16 bytes"):
        BlockCodec().encode(b"\0\0", dtype="float16", shape=(1,), namespace=NS[:15], key=KEY)
    with pytest.raises(ValueError, match="16 bytes"):
        BlockCodec().encode(b"\0\0", dtype="float16", shape=(1,), namespace=NS, key=KEY + b"!")


# -- identity checks ---------------------------------------------------------------------------

def test_block_of_another_namespace_is_a_namespace_mismatch():
    blob = encode(kv_like(torch.bfloat16), "zstd+shuffle", "bfloat16")
    for read in (BlockCodec.read_header, BlockCodec().decode):
        with pytest.raises(NamespaceMismatch) as info:
            read(blob, namespace=OTHER_NS, key=KEY)
        assert info.value.reason == "namespace_mismatch"
        assert isinstance(info.value, CorruptBlock)


def test_block_under_the_wrong_key_is_corrupt():
    blob = encode(kv_like(torch.bfloat16), "zstd", "bfloat16")
    with pytest.raises(CorruptBlock) as info:
        BlockCodec().decode(blob, namespace=NS, key=b"Q" * 16)
    assert info.value.reason == "corrupt"
    assert not isinstance(info.value, NamespaceMismatch)


def test_block_decodes_with_any_reading_codec_setting():
    t = kv_like(torch.float16)
    blob = encode(t, "zstd+shuffle", "float16")
    for reader in (BlockCodec("raw"), BlockCodec("zstd", level=19)):
        assert bytes(reader.decode(blob)[1]) == as_bytes(t).tobytes()


# -- corruption: every byte of every field ----------------------------------------------------
#
# The header is covered by its own xxh32 check, the stored body by a 32-bit check and the raw
# payload by its xxh3-64 checksum: every flipped byte anywhere is rejected, including the bits a
# zstd decompressor would ignore (an unused frame-header bit, the "has checksum" flag, ...).

FIELD_NAMES = ("magic", "version", "codec", "dtype", "level", "ndim", "flags", "shape", "namespace",
               "key", "raw_len", "stored_len", "checksum", "body_check", "created", "header_check")


def _header_spans() -> dict[str, tuple[int, int]]:
    order, body = HEADER.format[0], HEADER.format[1:]
    codes = re.findall(r"\d*[a-zA-Z?]", body)
    assert len(codes) == len(FIELD_NAMES), "HEADER changed: update FIELD_NAMES"
    spans, prefix = {}, ""
    for name, code in zip(FIELD_NAMES, codes, strict=True):
        start = struct.calcsize(order + prefix)
        prefix += code
        spans[name] = (start, struct.calcsize(order + prefix))
    assert spans["header_check"][1] == HEADER_BYTES
    return spans


SPANS = _header_spans()


class Fixture(typing.NamedTuple):
    blob: bytes
    payload: bytes
    regions: dict[str, tuple[int, int]]  # region name -> [start, end) in the blob
    zstd_frame: tuple[int, int]  # where the zstd frame lies, (0, 0) for raw bodies


def _make_blobs() -> dict[str, Fixture]:
    small = (2, 2, 16, 2, 16)
    cases = {
        "raw-bf16": ("raw", "bfloat16", kv_like(torch.bfloat16, small)),
        "zstd-fp8": ("zstd", "float8_e4m3fn", kv_like(torch.float8_e4m3fn, small)),
        "shuffle-bf16": ("zstd+shuffle", "bfloat16", kv_like(torch.bfloat16, small)),
        "shuffle-fp32": ("zstd+shuffle", "float32", torch.zeros(small).add_(1.5)),
    }
    blobs = {}
    for name, (codec, dtype_name, t) in cases.items():
        blob = encode(t, codec, dtype_name)
        header = BlockCodec.read_header(blob)
        assert header.codec == codec, name  # the fixture must exercise the codec it names
        regions = dict(SPANS)
        regions["body"] = (HEADER_BYTES, len(blob))
        frame = (0, 0)
        if codec == "zstd+shuffle":
            (packed,) = struct.unpack_from("<Q", blob, HEADER_BYTES)
            regions["shuffle_len"] = (HEADER_BYTES, HEADER_BYTES + 8)
            regions["high_planes"] = frame = (HEADER_BYTES + 8, HEADER_BYTES + 8 + packed)
            regions["low_plane"] = (HEADER_BYTES + 8 + packed, len(blob))
        else:
            regions["shuffle_len"] = regions["high_planes"] = regions["low_plane"] = regions["body"]
            if codec == "zstd":
                frame = regions["body"]
        blobs[name] = Fixture(blob, as_bytes(t).tobytes(), regions, frame)
    return blobs


BLOBS = _make_blobs()
REGIONS = (*FIELD_NAMES, "body", "shuffle_len", "high_planes", "low_plane")
FUZZ = settings(max_examples=25, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def assert_never_wrong_data(fx: Fixture, bad: bytes, *, header_intact: bool, ignorable: bool) -> None:
    """``bad`` is rejected as CorruptBlock("corrupt"), whatever namespace/key the caller expects.

    A flip inside the namespace field is corruption too (the header check fails before the
    namespace is compared): a damaged header is no evidence that the block is foreign. Only an
    intact header naming another namespace than the expected one is "namespace_mismatch".
    ``ignorable`` is kept for the regression below: before the body check, a flip inside a zstd
    frame that the decompressor ignored decoded (to the stored bytes); now it must be rejected.
    """
    attempts = [
        ({"namespace": NS, "key": KEY}, CorruptBlock),
        ({"namespace": OTHER_NS, "key": KEY}, NamespaceMismatch if header_intact else CorruptBlock),
        ({}, CorruptBlock),
        ({"namespace": NS, "key": KEY, "out": bytearray(len(fx.payload))}, CorruptBlock),
    ]
    for kwargs, expected in attempts:
        try:
            _, got = BlockCodec().decode(bad, **kwargs)
        except CorruptBlock as exc:
            assert type(exc) is expected, (kwargs, exc)
            assert exc.reason == expected.reason
            continue
        raise AssertionError(f"damaged block decoded with {kwargs} (in a zstd frame: {ignorable}); "
                             f"same bytes: {bytes(got) == fx.payload}")


def test_every_header_field_and_body_region_is_covered():
    for fx in BLOBS.values():
        assert set(fx.regions) == set(REGIONS)
        header_bytes = sorted(i for name in FIELD_NAMES for i in range(*fx.regions[name]))
        assert header_bytes == list(range(HEADER_BYTES))
        assert all(fx.regions[r][0] < fx.regions[r][1] for r in REGIONS)


@pytest.mark.parametrize("region", REGIONS)
@pytest.mark.parametrize("blob_name", sorted(BLOBS))
@FUZZ
@given(data=st.data(), mask=st.integers(1, 255))
def test_a_flipped_byte_anywhere_is_rejected_as_corrupt(blob_name, region, data, mask):
    fx = BLOBS[blob_name]
    start, end = fx.regions[region]
    pos = data.draw(st.integers(start, end - 1), label="position")
    bad = bytearray(fx.blob)
    bad[pos] ^= mask
    if pos < HEADER_BYTES:
        with pytest.raises(CorruptBlock):
            BlockCodec.read_header(bytes(bad), namespace=NS, key=KEY)
    assert_never_wrong_data(fx, bytes(bad), header_intact=pos >= HEADER_BYTES,
                            ignorable=fx.zstd_frame[0] <= pos < fx.zstd_frame[1])


@pytest.mark.parametrize("blob_name", ["zstd-fp8", "shuffle-bf16"])
def test_regression_zstd_ignored_frame_bits_decoded_a_damaged_block(blob_name):
    # exhaustive over the frame magic, descriptor, content size and first block header, where
    # the flips the decompressor ignores live (e.g. the descriptor's "has checksum" bit): before
    # the stored-body check such a damaged block decoded; now every flip is rejected
    fx = BLOBS[blob_name]
    start = fx.zstd_frame[0]
    for pos in range(start, start + 10):
        for mask in range(1, 256):
            bad = bytearray(fx.blob)
            bad[pos] ^= mask
            assert_never_wrong_data(fx, bytes(bad), header_intact=True, ignorable=True)


@pytest.mark.parametrize("blob_name", sorted(BLOBS))
@FUZZ
@given(data=st.data())
def test_a_truncated_block_is_rejected_as_corrupt(blob_name, data):
    fx = BLOBS[blob_name]
    length = data.draw(st.one_of(st.integers(0, len(fx.blob) - 1),
                                 st.sampled_from([0, HEADER_BYTES - 1, HEADER_BYTES, len(fx.blob) - 1])),
                       label="length")
    assert_never_wrong_data(fx, fx.blob[:length], header_intact=False, ignorable=False)


@pytest.mark.parametrize("blob_name", sorted(BLOBS))
@FUZZ
@given(tail=st.binary(min_size=1, max_size=64))
def test_trailing_bytes_after_a_block_are_rejected_as_corrupt(blob_name, tail):
    fx = BLOBS[blob_name]
    assert_never_wrong_data(fx, fx.blob + tail, header_intact=False, ignorable=False)


def test_untouched_fuzz_blobs_decode():
    # the corruption tests above only mean something if the originals are valid
    for fx in BLOBS.values():
        assert bytes(BlockCodec().decode(fx.blob, namespace=NS, key=KEY)[1]) == fx.payload
