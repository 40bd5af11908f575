"""Stored-block bodies: compressing a payload into a ``raw`` / ``zstd`` / ``zstd+shuffle`` body
and back, with the body's framing checked against the raw length before anything is decompressed.

``zstd+shuffle`` splits items of 2 or 4 bytes into byte planes; the high planes (sign/exponent,
compressible) are one zstd frame, the lowest plane (mantissa noise) is stored raw:
``u64 compressed_len | compressed high planes | raw low plane``. Every zstd frame must declare
exactly the content size the header promises, so a frame claiming 1 TiB is refused before a byte
is decompressed. A segmented block's segments are each such a body
(:mod:`tiered_kv.store.codec_segments`). Failures raise :class:`CorruptBlock`. No torch here.
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import xxhash
import zstandard

from tiered_kv.errors import CorruptBlock

SHUFFLE_SEP = struct.Struct("<Q")
DETAIL_CHARS = 160  # of an exception's message quoted in a CorruptBlock

CODECS = {"raw": 0, "zstd": 1, "zstd+shuffle": 2}  # codec name -> its code in headers and tables
CODEC_NAMES = {v: k for k, v in CODECS.items()}
# the most a zstd frame can expand: a block regenerates at most 128 KiB from at least 4 bytes
# (3 of block header, 1 of RLE byte), and a frame has a header of its own besides
ZSTD_MAX_RATIO = (128 << 10) // 4


class _Contexts(threading.local):
    """Per-thread zstd contexts (they are not thread-safe) and a scratch buffer."""

    def __init__(self) -> None:
        self.cctx: dict[int, zstandard.ZstdCompressor] = {}
        self.dctx = zstandard.ZstdDecompressor()
        self.scratch = bytearray()

    def compressor(self, level: int) -> zstandard.ZstdCompressor:
        cctx = self.cctx.get(level)
        if cctx is None:
            # a 128 KiB window and a tiny hash table: KV bytes have almost no real matches, so a
            # bigger table only finds spurious short ones. On bf16 KV, hash_log 8 vs 12: the same
            # or better ratio (shuffled 1.459 -> 1.467) and ~1.5-2x faster compress, ~1.2x faster
            # decompress (tools/bench_tiers.py, codec_encode/decode); zeros/repeats compress the same
            params = zstandard.ZstdCompressionParameters.from_level(
                level, window_log=17, hash_log=8, write_content_size=True)
            cctx = self.cctx[level] = zstandard.ZstdCompressor(compression_params=params)
        return cctx


_local = _Contexts()


def planes(raw: memoryview, size: int) -> tuple[bytes, bytes]:
    """Split ``raw`` (items of ``size`` bytes, little-endian) into (high planes, low plane)."""
    if size == 2:  # whole-word shifts and casts: ~8x faster than strided byte gathers
        words = np.frombuffer(raw, dtype="<u2")
        return np.right_shift(words, 8).astype(np.uint8).data, words.astype(np.uint8).data
    arr = np.frombuffer(raw, dtype=np.uint8).reshape(-1, size)
    high = np.ascontiguousarray(arr[:, :0:-1].T)
    low = np.ascontiguousarray(arr[:, 0])
    return high.data, low.data


def compress_body(codec: str, raw: memoryview, size: int, level: int):
    """The body of ``raw`` (items of ``size`` bytes) under ``codec``."""
    if codec == "raw":
        return raw
    cctx = _local.compressor(level)
    if codec == "zstd":
        return cctx.compress(raw)
    high, low = planes(raw, size)
    packed = cctx.compress(high)
    return b"".join((SHUFFLE_SEP.pack(len(packed)), packed, low))


def body_parts(codec: str, size: int, raw_len: int, body: memoryview) -> tuple[memoryview, memoryview]:
    """(raw body or zstd frame, raw low plane) of a body, its framing checked against the raw
    length: the shuffle planes' sizes and each frame's declared content size."""
    if codec == "raw":
        return body, body[:0]
    if codec == "zstd":
        check_frame(body, raw_len)
        return body, body[:0]
    n = raw_len // size
    if len(body) < SHUFFLE_SEP.size:
        raise CorruptBlock("truncated shuffle body")
    (packed_len,) = SHUFFLE_SEP.unpack(body[: SHUFFLE_SEP.size])
    if packed_len > len(body) - SHUFFLE_SEP.size or len(body) - SHUFFLE_SEP.size - packed_len != n:
        raise CorruptBlock("shuffle planes do not match the raw length")
    packed = body[SHUFFLE_SEP.size : SHUFFLE_SEP.size + packed_len]
    check_frame(packed, n * (size - 1))
    return packed, body[SHUFFLE_SEP.size + packed_len :]


def check_frame(src: memoryview, expected: int) -> None:
    """A zstd frame must declare exactly ``expected`` bytes of content."""
    try:
        frame = zstandard.get_frame_parameters(src)
    except zstandard.ZstdError as exc:
        raise CorruptBlock(f"bad zstd frame: {short(exc)}") from None
    if frame.content_size != expected:
        raise CorruptBlock(f"zstd frame declares {frame.content_size} bytes, expected {expected}")


def room(codec: str, size: int, stored_len: int) -> int:
    """The most raw bytes a ``codec`` body of ``stored_len`` bytes (items of ``size``) can hold:
    a declared raw length above it is a lie, refused before anything is allocated."""
    if codec == "raw":
        return stored_len
    return size * stored_len if codec == "zstd+shuffle" else ZSTD_MAX_RATIO * stored_len


def short(exc: BaseException) -> str:
    """An exception's message on one line, at most DETAIL_CHARS long."""
    text = " ".join(str(exc).split())
    return text if len(text) <= DETAIL_CHARS else text[: DETAIL_CHARS - 3] + "..."


def decompress_exact(dctx: zstandard.ZstdDecompressor, src: memoryview, dst: memoryview) -> None:
    """Decompress ``src`` (a frame declaring ``len(dst)`` bytes) into exactly ``dst``; any other
    size is corruption."""
    reader = dctx.stream_reader(src, read_size=len(src))
    got = 0
    while got < len(dst):
        n = reader.readinto(dst[got:])
        if n == 0:
            break
        got += n
    if got != len(dst) or reader.read(1):
        raise CorruptBlock("zstd frame size mismatch")


def copy_bytes(dst: memoryview, src) -> None:
    """``dst[:] = src`` for buffers of equal length, without holding the GIL (NumPy releases
    it while copying; a memoryview slice assignment does not: two threads would take turns)."""
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def clear(dst: memoryview) -> None:
    """Zero ``dst`` (no decoded byte of a block that failed stays in a caller's buffer)."""
    np.frombuffer(dst, dtype=np.uint8).fill(0)


def undecodable(exc: BaseException) -> CorruptBlock:
    """A failure of any other type while reading stored bytes, as the CorruptBlock it is."""
    if isinstance(exc, zstandard.ZstdError):
        return CorruptBlock(f"zstd: {short(exc)}")
    return CorruptBlock(f"undecodable block: {type(exc).__name__}: {short(exc)}".rstrip(": "))


def body_check(body) -> int:
    """32-bit check of the stored body (xxh3 is ~3x faster than xxh32 on large buffers)."""
    return xxhash.xxh3_64_intdigest(body) & 0xFFFFFFFF


def decompress_body(codec: str, size: int, raw_len: int, parts: tuple[memoryview, memoryview],
                    dst: memoryview) -> None:
    """Decompress ``parts`` (from :func:`body_parts`) into exactly ``dst``."""
    packed, low = parts
    if codec == "raw":
        copy_bytes(dst, packed)
        return
    dctx = _local.dctx
    if codec == "zstd":
        decompress_exact(dctx, packed, dst)
        return
    n = raw_len // size
    scratch = _local.scratch
    if len(scratch) < n * (size - 1):
        scratch = _local.scratch = bytearray(n * (size - 1))
    high = memoryview(scratch)[: n * (size - 1)]
    decompress_exact(dctx, packed, high)
    hi = np.frombuffer(high, dtype=np.uint8)
    lo = np.frombuffer(low, dtype=np.uint8)
    if size == 2:
        out16 = np.frombuffer(dst, dtype="<u2")
        np.left_shift(hi, 8, out=out16, dtype=out16.dtype)
        np.bitwise_or(out16, lo, out=out16)
    else:
        arr = np.frombuffer(dst, dtype=np.uint8).reshape(n, size)
        arr[:, 0] = lo
        arr[:, :0:-1] = hi.reshape(size - 1, n).T
