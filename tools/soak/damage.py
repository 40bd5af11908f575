"""Damaged stored blocks: random byte flips, and lying headers — blocks that pass every header
check (valid header checksum, valid body check) but declare another shape, dtype, size or codec
than the namespace's block, or carry a zstd frame declaring a huge content size."""

from __future__ import annotations

import random
import struct
from collections.abc import Callable

import numpy as np
import xxhash

from soak.common import NS, SHAPE, payload_bytes
from tiered_kv.store.codec import CODECS, DTYPE_CODES, HEADER, HEADER_BYTES, BlockCodec

FIELDS = ("magic", "version", "codec", "dtype", "level", "ndim", "flags", "d0", "d1", "d2", "d3", "d4",
          "d5", "namespace", "key", "raw_len", "stored_len", "checksum", "body_check", "created", "check")
HUGE_SHAPE = (65536, 65536, 8)  # 2^35 bf16 values: a 64 GiB block
HUGE_BYTES = 2 * 65536 * 65536 * 8
HEADER_SHARE = 0.3  # share of flips aimed at the header (the rest hit the body)


def flip(blob: bytes, rng: random.Random) -> tuple[bytes, str]:
    """One byte XORed with a non-zero mask, in the header or the body; (new blob, region)."""
    in_header = rng.random() < HEADER_SHARE or len(blob) <= HEADER_BYTES
    pos = rng.randrange(HEADER_BYTES) if in_header else rng.randrange(HEADER_BYTES, len(blob))
    out = bytearray(blob)
    out[pos] ^= rng.randrange(1, 256)
    return bytes(out), "header" if in_header else "body"


def patch_header(blob: bytes, **changes) -> bytes:
    """``blob`` with header fields replaced and the header check recomputed (a consistent lie)."""
    fields = dict(zip(FIELDS, HEADER.unpack(blob[:HEADER_BYTES])))
    fields.update(changes)
    head = HEADER.pack(*(fields[f] for f in FIELDS))
    check = struct.pack("<I", xxhash.xxh32_intdigest(head[:-4]))
    return head[:-4] + check + blob[HEADER_BYTES:]


def body_check(body: bytes) -> int:
    """The codec's 32-bit body check (xxh3-64 truncated), recomputed for crafted bodies."""
    return xxhash.xxh3_64_intdigest(body) & 0xFFFFFFFF


def zstd_frame(content_size: int, data: bytes) -> bytes:
    """A well-formed zstd frame that declares ``content_size`` bytes but holds only ``data``
    (one raw block): frame header with an 8-byte content size, 128 KiB window, no checksum."""
    assert len(data) < 1 << 17
    header = (0xFD2FB528).to_bytes(4, "little") + bytes([0b11000000, 7 << 3]) + content_size.to_bytes(8, "little")
    block = (1 | (len(data) << 3)).to_bytes(3, "little")  # last block, raw, size
    return header + block + data


def _other(key: bytes, n: int = 1) -> np.ndarray:
    """Payload bytes of another key (so a lie that is served shows up as wrong bytes)."""
    return np.concatenate([payload_bytes(bytes(reversed(key)) + bytes([i])) for i in range(n)])


def _encode(key: bytes, raw: np.ndarray, dtype: str, shape: tuple[int, ...], codec: str = "zstd+shuffle") -> bytes:
    return BlockCodec(codec).encode(raw, dtype=dtype, shape=shape, namespace=NS.digest(), key=key)


def _crafted(key: bytes, codec: str, shape: tuple[int, ...], raw_len: int, checksum: int, body: bytes) -> bytes:
    """A header built field by field around ``body`` (valid header check and body check)."""
    dims = tuple(shape) + (0,) * (6 - len(shape))
    fields = (b"TKVB", 1, CODECS[codec], DTYPE_CODES["bfloat16"], 1, len(shape), 0, *dims, NS.digest(), key,
              raw_len, len(body), checksum, body_check(body), 0.0, 0)
    head = HEADER.pack(*fields)
    return head[:-4] + struct.pack("<I", xxhash.xxh32_intdigest(head[:-4])) + body


def lie_shape_permuted(key: bytes, blob: bytes) -> bytes:
    """Same byte count, another shape (layers and K/V swapped)."""
    return _encode(key, _other(key), "bfloat16", (2, 4, 16, 2, 32))


def lie_shape_flat(key: bytes, blob: bytes) -> bytes:
    """Same byte count, one dimension."""
    return _encode(key, _other(key), "bfloat16", (int(np.prod(SHAPE)),))


def lie_shape_bigger(key: bytes, blob: bytes) -> bytes:
    """Twice the bytes: block size 32 instead of 16."""
    return _encode(key, _other(key, 2), "bfloat16", (4, 2, 32, 2, 32))


def lie_shape_smaller(key: bytes, blob: bytes) -> bytes:
    """Half the bytes: two layers instead of four."""
    return _encode(key, _other(key)[: len(payload_bytes(key)) // 2], "bfloat16", (2, 2, 16, 2, 32))


def lie_dtype_same_size(key: bytes, blob: bytes) -> bytes:
    """float16 instead of bfloat16, same shape and byte count."""
    return _encode(key, _other(key), "float16", SHAPE)


def lie_dtype_bigger(key: bytes, blob: bytes) -> bytes:
    """float32 instead of bfloat16: same shape, twice the bytes."""
    return _encode(key, _other(key, 2), "float32", SHAPE)


def lie_codec(key: bytes, blob: bytes) -> bytes:
    """The right block with its codec field changed (zstd+shuffle <-> zstd)."""
    codec = blob[6]  # HEADER: 4s magic, H version, B codec
    other = CODECS["zstd"] if codec == CODECS["zstd+shuffle"] else CODECS["zstd+shuffle"]
    return patch_header(blob, codec=other)


def lie_zstd_bomb_declared(key: bytes, blob: bytes) -> bytes:
    """Header and zstd frame both declare a 64 GiB block."""
    body = zstd_frame(HUGE_BYTES, bytes(1024))
    return _crafted(key, "zstd", HUGE_SHAPE, HUGE_BYTES, 0, body)


def lie_zstd_bomb_frame(key: bytes, blob: bytes) -> bytes:
    """The namespace's shape in the header, a frame declaring 64 GiB."""
    raw = payload_bytes(key)
    body = zstd_frame(HUGE_BYTES, bytes(1024))
    return _crafted(key, "zstd", SHAPE, len(raw), xxhash.xxh3_64_intdigest(raw), body)


def lie_zstd_short_frame(key: bytes, blob: bytes) -> bytes:
    """A frame declaring the right size but holding 1 KiB."""
    raw = payload_bytes(key)
    body = zstd_frame(len(raw), bytes(raw[:1024]))
    return _crafted(key, "zstd", SHAPE, len(raw), xxhash.xxh3_64_intdigest(raw), body)


def lie_shuffle_length(key: bytes, blob: bytes) -> bytes:
    """zstd+shuffle body whose high-plane length field claims 2^40 bytes."""
    raw = payload_bytes(key)
    body = struct.pack("<Q", 1 << 40) + bytes(64) + bytes(raw[1::2])
    return _crafted(key, "zstd+shuffle", SHAPE, len(raw), xxhash.xxh3_64_intdigest(raw), body)


LIES: dict[str, Callable[[bytes, bytes], bytes]] = {
    "shape_permuted": lie_shape_permuted, "shape_flat": lie_shape_flat,
    "shape_bigger": lie_shape_bigger, "shape_smaller": lie_shape_smaller,
    "dtype_same_size": lie_dtype_same_size, "dtype_bigger": lie_dtype_bigger,
    "codec": lie_codec, "zstd_bomb_declared": lie_zstd_bomb_declared,
    "zstd_bomb_frame": lie_zstd_bomb_frame, "zstd_short_frame": lie_zstd_short_frame,
    "shuffle_length": lie_shuffle_length,
}


def self_consistent(blob: bytes) -> bool:
    """Whether ``blob``'s header passes the codec's own header checks (a lie must)."""
    try:
        BlockCodec.read_header(blob, namespace=NS.digest())
        return True
    except Exception:
        return False
