"""Segmented stored blocks (tiered_kv.store.codec_segments): a block cut into layer groups that
a loader checks and decodes one group at a time. What is pinned: round trips of every codec and
dtype, one segment writing exactly the unsegmented block, every flipped byte caught by the check
that covers it (and only the segment it lies in lost), lying tables refused at open before
anything is allocated, and no byte of a failed segment left in the caller's buffer."""

from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor
from math import prod

import numpy as np
import pytest
import xxhash

from tests.unit.test_lying_blocks import peak_of
from tiered_kv.admin.block_checks import check_block
from tiered_kv.dtypes import ITEMSIZE
from tiered_kv.errors import CorruptBlock, NamespaceMismatch
from tiered_kv.store.codec import (
    CODECS,
    DTYPE_CODES,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    MAX_NDIM,
    SEGMENTED,
    VERSION,
    BlockCodec,
    BlockLayout,
    max_stored_len,
)
from tiered_kv.store.codec_segments import ENTRY, MAX_SEGMENTS, TABLE_HEAD, table_len

NS = bytes(range(16))
OTHER_NS = bytes(range(1, 17))
KEY = b"K" * 16
CREATED = 1234.5
# [layers, 2, block_size, heads, dim]
SHAPE = (8, 2, 16, 4, 32)
DTYPES = ("bfloat16", "float32", "uint8")  # uint8: an fp8-like 1-byte KV
SMALL_PEAK = 256 << 10  # what refusing a lying block may cost, at most


def kv_bytes(dtype: str, shape=SHAPE, seed: int = 0) -> bytes:
    """KV-like bytes: Gaussian values with per-channel scales (compressible exponents, noisy
    mantissas); uint8 gets small integers (compressible, as fp8 KV is)."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.standard_normal(shape[-2:])) * 0.5
    vals = rng.standard_normal(shape) * scale
    if dtype == "uint8":
        return (np.abs(vals) * 8).clip(0, 255).astype(np.uint8).tobytes()
    f32 = vals.astype(np.float32)
    if dtype == "float32":
        return f32.tobytes()
    return (f32.view(np.uint32) >> 16).astype(np.uint16).tobytes()  # bfloat16: the high halves


def plan(name: str, raw_len: int, size: int, layers: int = SHAPE[0]) -> list[int] | None:
    """Segment lengths: ``one`` (the whole payload), ``two``/``eight`` layer groups, ``uneven``
    (1, 3 layers, then a cut inside a layer, on an item boundary)."""
    layer = raw_len // layers
    if name == "none":
        return None
    if name == "one":
        return [raw_len]
    if name == "two":
        return [raw_len // 2] * 2
    if name == "eight":
        return [layer] * layers
    return [layer, 3 * layer, 4 * layer - 5 * size, 5 * size]


def encode(payload, codec="zstd+shuffle", dtype="bfloat16", shape=SHAPE, **kw) -> bytes:
    return BlockCodec(codec).encode(payload, dtype=dtype, shape=shape, namespace=NS, key=KEY,
                                    created=CREATED, **kw)


def table_of(blob) -> list[tuple]:
    """The entries of a segmented block's table: (raw_len, stored_len, raw hash, check, codec)."""
    (n,) = TABLE_HEAD.unpack_from(blob, HEADER_BYTES)
    return list(ENTRY.iter_unpack(blob[HEADER_BYTES + TABLE_HEAD.size : HEADER_BYTES + table_len(n)]))




# -- round trips -------------------------------------------------------------------------------

@pytest.mark.parametrize("into", [False, True], ids=["bytes", "into"])
@pytest.mark.parametrize("segments", ["one", "two", "eight", "uneven"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", sorted(CODECS))
def test_segmented_block_round_trips_whole_and_segment_by_segment(codec, dtype, segments, into):
    raw = kv_bytes(dtype)
    size = ITEMSIZE[dtype]
    shape = SHAPE
    lengths = plan(segments, len(raw), size)
    plain = encode(raw, codec, dtype, shape, segments=lengths)
    if into:
        arena = bytearray(b"\x5a" * (max_stored_len(len(raw), len(lengths)) + 13))
        blob = encode(raw, codec, dtype, shape, segments=lengths, into=arena)
        assert isinstance(blob, memoryview) and blob.obj is arena  # written in place, a view
        assert bytes(blob) == plain  # the same block either way
    else:
        blob = plain
    header, payload = BlockCodec().decode(blob, namespace=NS, key=KEY, expect=BlockLayout(dtype, shape))
    assert bytes(payload) == raw
    assert header.segmented == (len(lengths) > 1)
    assert header.codec == ("zstd" if codec == "zstd+shuffle" and size == 1 else codec)
    assert len(blob) <= max_stored_len(len(raw), len(lengths))

    block = BlockCodec.segments(blob, namespace=NS, key=KEY, expect=BlockLayout(dtype, shape))
    starts = np.cumsum([0, *lengths])
    assert block.bounds == list(zip(starts[:-1].tolist(), starts[1:].tolist()))
    assert block.raw_len == len(raw) and len(block) == len(lengths) and block.header == header
    for j in reversed(range(len(block))):  # any order: each segment stands alone
        start, end = block.bounds[j]
        out = bytearray(b"\xa5" * (end - start))
        view = block.decode(j, out)
        assert bytes(out) == raw[start:end] and view.obj is out


def test_segments_that_do_not_compress_are_stored_raw_each_on_its_own():
    layer = len(kv_bytes("bfloat16")) // SHAPE[0]
    noise = np.random.default_rng(1).integers(0, 256, 4 * layer, dtype=np.uint8).tobytes()
    raw = bytes(4 * layer) + noise  # layers 0-3 zeros, 4-7 incompressible
    mixed = encode(raw, segments=[4 * layer, 4 * layer])
    assert BlockCodec.read_header(mixed).codec == "zstd+shuffle"
    (_, zeros, _, _, zeros_codec), (_, noise_len, _, _, noise_codec) = table_of(mixed)
    assert (zeros_codec, noise_codec, noise_len) == (CODECS["zstd+shuffle"], CODECS["raw"], 4 * layer)
    assert zeros < 4 * layer // 2 + 64  # shuffled zeros: the low plane (stored raw) and a tiny frame
    assert bytes(BlockCodec().decode(mixed)[1]) == raw
    # every segment raw: the header says raw, as an unsegmented incompressible block would
    blob = encode(noise + noise, segments=[4 * layer, 4 * layer])
    assert BlockCodec.read_header(blob).codec == "raw"
    assert len(blob) == max_stored_len(len(raw), 2)
    assert bytes(BlockCodec().decode(blob)[1]) == noise + noise


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_one_segment_writes_exactly_the_unsegmented_block(codec):
    raw = kv_bytes("bfloat16")
    today = encode(raw, codec)
    assert encode(raw, codec, segments=[len(raw)]) == today
    assert encode(raw, codec, segments=(len(raw),), into=bytearray(max_stored_len(len(raw)))) == today
    assert BlockCodec.read_header(today).flags == 0


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_an_unsegmented_block_opens_as_one_segment_covering_the_payload(codec):
    raw = kv_bytes("float32")
    block = BlockCodec.segments(encode(raw, codec, "float32"), namespace=NS, key=KEY)
    assert block.bounds == [(0, len(raw))] and len(block) == 1 and not block.header.segmented
    out = bytearray(len(raw))
    block.decode(0, out)
    assert out == raw


def test_one_opened_block_decodes_its_segments_on_several_threads_at_once():
    raw = kv_bytes("bfloat16")
    lengths = plan("eight", len(raw), 2)
    block = BlockCodec.segments(encode(raw, segments=lengths))
    got: dict[int, bytes] = {}

    def work(j: int) -> None:
        out = bytearray(lengths[j])
        for _ in range(5):
            block.decode(j, out)
        got[j] = bytes(out)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(work, range(len(block))))
    assert b"".join(got[j] for j in range(len(block))) == raw


def test_admin_block_checks_read_segmented_blocks():
    raw = kv_bytes("bfloat16")
    blob = encode(raw, segments=plan("eight", len(raw), 2))
    header, payload = check_block(NS + KEY, blob, None)
    assert header.segmented and bytes(payload) == raw
    assert check_block(NS + KEY, blob, None, decode=False).stored_len == len(blob) - HEADER_BYTES


# -- arguments -----------------------------------------------------------------------------------

@pytest.mark.parametrize("segments", [[], [0, 4096], [4095, 4097], [4096, 4095], [-2, 8194], [1.5],
                                      [2] * (MAX_SEGMENTS + 1), "ab"])
def test_segments_that_do_not_cut_the_payload_into_items_raise_value_error(segments):
    raw = bytes(8192)
    with pytest.raises(ValueError) as info:
        encode(raw, "zstd", "float16", (64, 64), segments=segments)
    assert not isinstance(info.value, CorruptBlock)


def test_an_into_buffer_smaller_than_max_stored_len_raises_value_error():
    raw = kv_bytes("bfloat16")
    lengths = plan("two", len(raw), 2)
    with pytest.raises(ValueError, match="into"):
        encode(raw, segments=lengths, into=bytearray(max_stored_len(len(raw), 2) - 1))
    assert max_stored_len(len(raw), 2) == HEADER_BYTES + len(raw) + table_len(2)
    assert max_stored_len(len(raw), 1) == max_stored_len(len(raw)) == HEADER_BYTES + len(raw)


def test_a_segment_buffer_of_the_wrong_size_raises_value_error_and_is_left_alone():
    raw = kv_bytes("bfloat16")
    block = BlockCodec.segments(encode(raw, segments=plan("two", len(raw), 2)))
    for delta in (-2, 2):
        out = bytearray(b"\xa5" * (len(raw) // 2 + delta))
        with pytest.raises(ValueError, match="segment 1") as info:
            block.decode(1, out)
        assert not isinstance(info.value, CorruptBlock) and set(out) == {0xA5}
    with pytest.raises(IndexError):
        block.decode(2, bytearray(len(raw) // 2))


# -- identity -------------------------------------------------------------------------------------

def test_segment_open_checks_namespace_key_and_layout():
    raw = kv_bytes("bfloat16")
    blob = encode(raw, segments=plan("two", len(raw), 2))
    with pytest.raises(NamespaceMismatch):
        BlockCodec.segments(blob, namespace=OTHER_NS, key=KEY)
    with pytest.raises(CorruptBlock, match="key"):
        BlockCodec.segments(blob, namespace=NS, key=b"Q" * 16)
    with pytest.raises(CorruptBlock, match="namespace's block"):
        BlockCodec.segments(blob, expect=BlockLayout("bfloat16", (4, 2, 16, 4, 64)))
    with pytest.raises(CorruptBlock, match="limit"):
        BlockCodec.segments(blob, max_raw=len(raw) - 1)


# -- every flipped byte ---------------------------------------------------------------------------

def _small_blocks() -> dict[str, tuple[bytes, bytes, list[int]]]:
    """Small segmented blocks whose segments exercise every body kind: (blob, payload, lengths)."""
    shape = (4, 2, 4, 2, 8)  # 512 items per block, 128 per layer
    zeros = bytes(256)
    noise = np.random.default_rng(3).integers(0, 256, 256, dtype=np.uint8).tobytes()
    mixed = kv_bytes("bfloat16", (2, 2, 4, 2, 8), seed=5)
    bf16 = zeros + noise + mixed  # shuffled zeros, a raw segment, two KV layers
    fp8 = bytes(128) + noise[:128] + bytes(range(128)) * 2
    out = {}
    for name, codec, dtype, raw, lengths in (
            ("shuffle-bf16", "zstd+shuffle", "bfloat16", bf16, [256, 256, 256, 256]),
            ("zstd-fp8", "zstd", "uint8", fp8, [128, 128, 256]),
            ("raw-f32", "raw", "float32", bf16 * 2, [512, 1024, 512])):
        blob = encode(raw, codec, dtype, shape, segments=lengths)
        out[name] = (blob, raw, lengths)
    return out


SMALL = _small_blocks()


def test_the_small_blocks_exercise_raw_and_compressed_segments():
    codes = {name: {e[4] for e in table_of(blob)} for name, (blob, _, _) in SMALL.items()}
    assert codes == {"shuffle-bf16": {CODECS["raw"], CODECS["zstd+shuffle"]},
                     "zstd-fp8": {CODECS["raw"], CODECS["zstd"]}, "raw-f32": {CODECS["raw"]}}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_every_flipped_byte_is_caught_and_only_its_own_segment_is_lost(name):
    blob, raw, lengths = SMALL[name]
    opened_at = HEADER_BYTES + table_len(len(lengths))
    stored = np.cumsum([opened_at] + [e[1] for e in table_of(blob)]).tolist()
    bounds = np.cumsum([0, *lengths]).tolist()
    for pos in range(len(blob)):
        bad = bytearray(blob)
        bad[pos] ^= pos % 255 + 1
        out = bytearray(b"\xa5" * len(raw))
        with pytest.raises(CorruptBlock):
            BlockCodec().decode(bytes(bad), namespace=NS, key=KEY, out=out)
        assert set(out) <= {0} or set(out) == {0xA5}, f"byte {pos}: a decoded byte stayed in out"
        if pos < opened_at:  # header or table: refused at open
            with pytest.raises(CorruptBlock):
                BlockCodec.segments(bytes(bad), namespace=NS, key=KEY)
            continue
        block = BlockCodec.segments(bytes(bad), namespace=NS, key=KEY)
        hit = next(j for j in range(len(lengths)) if stored[j] <= pos < stored[j + 1])
        for j in range(len(lengths)):
            seg = bytearray(b"\xa5" * lengths[j])
            if j == hit:
                with pytest.raises(CorruptBlock, match=f"segment {j}"):
                    block.decode(j, seg)
                assert set(seg) == {0}, f"byte {pos}: segment {j} not cleared"
            else:
                block.decode(j, seg)
                assert seg == raw[bounds[j] : bounds[j + 1]], f"byte {pos}: good segment {j} lost"


@pytest.mark.parametrize("name", sorted(SMALL))
def test_a_truncated_or_extended_segmented_block_is_refused_at_open(name):
    blob = SMALL[name][0]
    for bad in (blob[:-1], blob[: HEADER_BYTES + 3], blob + b"\0"):
        with pytest.raises(CorruptBlock):
            BlockCodec.segments(bad)
        with pytest.raises(CorruptBlock):
            BlockCodec().decode(bad)


# -- lying tables ---------------------------------------------------------------------------------

def forge(table: bytes, bodies: bytes = b"", *, codec="zstd+shuffle", dtype="bfloat16", shape=(4, 64),
          flags=SEGMENTED) -> bytes:
    """A segmented block with whatever table it is told, under a header (and table hashes) that
    agree with it: only the table's content can tell it is a lie."""
    body = table + bodies
    dims = tuple(shape) + (0,) * (MAX_NDIM - len(shape))
    raw_len = prod(shape) * ITEMSIZE[dtype]
    head = HEADER.pack(MAGIC, VERSION, CODECS[codec], DTYPE_CODES[dtype], 1, len(shape), flags, *dims, NS,
                       KEY, raw_len, len(body), xxhash.xxh3_64_intdigest(table),
                       xxhash.xxh32_intdigest(table), 0.0, 0)
    return head[:-4] + struct.pack("<I", xxhash.xxh32_intdigest(head[:-4])) + body


def table(*entries, count: int | None = None) -> bytes:
    return TABLE_HEAD.pack(len(entries) if count is None else count) + b"".join(ENTRY.pack(*e) for e in entries)


def raw_entry(data: bytes) -> tuple:
    digest = xxhash.xxh3_64_intdigest(data)
    return (len(data), len(data), digest, digest & 0xFFFFFFFF, CODECS["raw"])


HALF = bytes(range(256))  # half of a (4, 64) bf16 block


def zstd_frame_declaring(content_size: int) -> bytes:
    head = struct.pack("<IB", 0xFD2FB528, 0xE0) + struct.pack("<Q", content_size)
    return head + struct.pack("<I", 1 | (1 << 1) | (4 << 3))[:3] + b"\x00"


LIES = {
    "count_0": forge(table(count=0), HALF * 2),
    "count_1": forge(table(raw_entry(HALF * 2)), HALF * 2),
    "count_huge": forge(table(raw_entry(HALF), raw_entry(HALF), count=(1 << 32) - 1), HALF * 2),
    "count_over_max": forge(table(*[raw_entry(b"\1\2")] * (MAX_SEGMENTS + 1)), b"\1\2" * (MAX_SEGMENTS + 1),
                            codec="raw", dtype="uint8", shape=(2 * MAX_SEGMENTS + 2,)),
    "raw_lengths_short": forge(table(raw_entry(HALF), raw_entry(HALF[:254])), HALF * 2),
    "stored_lengths_short": forge(table(raw_entry(HALF), raw_entry(HALF)), HALF * 2 + b"\0"),
    "huge_raw_segment": forge(table((1 << 40, 256, 0, 0, CODECS["zstd"]), raw_entry(HALF)),
                              HALF * 2, codec="zstd"),
    "segment_over_its_room": forge(table((256, 2, 0, 0, CODECS["zstd+shuffle"]), raw_entry(HALF)),
                                   b"\0\0" + HALF, shape=(2, 2, 64)),
    "unknown_codec": forge(table(raw_entry(HALF), (*raw_entry(HALF)[:4], 7)), HALF * 2),
    "codec_not_the_blocks": forge(table(raw_entry(HALF), (256, 256, 0, 0, CODECS["zstd"])), HALF * 2),
    "raw_segment_longer_than_its_payload": forge(
        table(raw_entry(HALF), (256, 258, *raw_entry(HALF)[2:])), HALF * 2 + b"\0\0"),
    "zero_raw_segment": forge(table((0, 0, 0, 0, 0), raw_entry(HALF), raw_entry(HALF)), HALF * 2),
    "segment_splitting_an_item": forge(table(raw_entry(HALF[:255]), raw_entry(HALF + b"\0")),
                                       HALF * 2 + b"\0"),
    "all_raw_under_a_zstd_header": forge(table(raw_entry(HALF), raw_entry(HALF)), HALF * 2, codec="zstd"),
    "unknown_flag": forge(table(raw_entry(HALF), raw_entry(HALF)), HALF * 2, flags=SEGMENTED | 4),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_lying_segment_table_is_refused_at_open_before_allocating(lie):
    blob = LIES[lie]
    for open_it in (lambda: BlockCodec.segments(blob, namespace=NS, key=KEY),
                    lambda: BlockCodec.segments(blob, expect=BlockLayout("bfloat16", (4, 64))),
                    lambda: BlockCodec().decode(blob, out=bytearray(512))):
        raised, peak = peak_of(open_it)
        assert isinstance(raised, CorruptBlock) and raised.reason == "corrupt", repr(raised)
        assert peak < SMALL_PEAK and "\n" not in raised.detail


def test_the_forger_makes_blocks_the_codec_reads_when_they_tell_the_truth():
    honest = forge(table(raw_entry(HALF), raw_entry(HALF[::-1])), HALF + HALF[::-1], codec="raw")
    assert bytes(BlockCodec().decode(honest, namespace=NS, key=KEY)[1]) == HALF + HALF[::-1]


def test_a_segment_frame_declaring_one_tebibyte_is_refused_before_allocating():
    frame = zstd_frame_declaring(1 << 40)
    digest = xxhash.xxh3_64_intdigest(HALF)
    blob = forge(table(raw_entry(HALF), (256, len(frame), digest, xxhash.xxh3_64_intdigest(frame) & 0xFFFFFFFF,
                                         CODECS["zstd"])), HALF + frame, codec="zstd")
    block = BlockCodec.segments(blob)
    out = bytearray(b"\xa5" * 256)
    raised, peak = peak_of(lambda: block.decode(1, out))
    assert isinstance(raised, CorruptBlock) and "frame declares" in raised.detail and peak < SMALL_PEAK
    assert set(out) == {0}
    block.decode(0, out)  # the good segment still decodes
    assert out == HALF


def test_a_segment_whose_payload_hash_fails_after_decompressing_leaves_nothing_in_out():
    raw = kv_bytes("bfloat16")
    lengths = plan("two", len(raw), 2)
    blob = bytearray(encode(raw, segments=lengths))
    entry = HEADER_BYTES + TABLE_HEAD.size + ENTRY.size  # segment 1's entry
    fields = list(ENTRY.unpack_from(blob, entry))
    assert fields[4] == CODECS["zstd+shuffle"]
    fields[2] ^= 1  # its payload hash lies; the table's hashes and the header agree with the lie
    ENTRY.pack_into(blob, entry, *fields)
    relied = forge(bytes(blob[HEADER_BYTES : HEADER_BYTES + table_len(2)]),
                   bytes(blob[HEADER_BYTES + table_len(2) :]), shape=SHAPE)
    block = BlockCodec.segments(relied)
    out = bytearray(b"\xa5" * lengths[1])
    with pytest.raises(CorruptBlock, match="segment 1: payload checksum mismatch"):
        block.decode(1, out)
    assert set(out) == {0}
    whole = bytearray(b"\xa5" * len(raw))  # segment 0 was written before segment 1 failed
    with pytest.raises(CorruptBlock):
        BlockCodec().decode(relied, out=whole)
    assert set(whole) == {0}
    block.decode(0, out)
    assert out == raw[: lengths[0]]
