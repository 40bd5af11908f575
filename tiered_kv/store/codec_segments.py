"""Segmented blocks: a stored block cut into consecutive byte ranges of its payload (segments:
e.g. layers 0-3 of a ``[layers, 2, block_size, heads, dim]`` block), each compressed and checked
on its own, so a loader can check and decode layer group 0 of every block, hand it to the engine,
then group 1, ... without first reading (or trusting) the rest of each block.

The body of a block whose header carries the SEGMENTED flag is a segment table followed by each
segment's body (made by :mod:`tiered_kv.store.codec_body` with the block's codec, or ``raw`` where
compressing did not make it smaller), in payload order; little-endian::

    u32 count
    count x (u64 raw_len, u64 stored_len, u64 raw xxh3-64, u32 stored check, u8 codec)

What checks what: the header's own xxh32 covers the header; its ``checksum`` is the xxh3-64 of
the table bytes and its ``body_check`` their xxh32 (two independent hashes of the framing of
every other byte); per segment, ``stored check`` (xxh3-64 & 0xFFFFFFFF of the stored body) is
verified before that body is decompressed or copied, and ``raw xxh3-64`` of the segment's payload
bytes after decompressing (a raw segment's stored body is its payload: its one xxh3-64 is checked
before a byte is copied out, and its stored check must be that hash's low half). The table must
account for every body byte, so every stored byte is covered by a check verified before any byte
decoded from it is used.

Opening a block (:func:`open_segments`) validates the whole table against the header (hashes,
count, lengths and their sums, each segment's codec and the room its body has) without touching a
segment body; :meth:`BlockSegments.decode` then validates one segment and writes exactly its bytes.
An unsegmented block opens as one segment covering the payload (the header's checksums are that
segment's). No torch here.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Sequence
from typing import Any

import xxhash

from tiered_kv.errors import CorruptBlock
from tiered_kv.store.codec_body import (
    CODEC_NAMES,
    CODECS,
    body_check,
    body_parts,
    clear,
    compress_body,
    copy_bytes,
    decompress_body,
    room,
    undecodable,
)
from tiered_kv.store.codec_header import HEADER_BYTES

TABLE_HEAD = struct.Struct("<I")
ENTRY = struct.Struct("<QQQIB")  # raw_len, stored_len, raw xxh3-64, stored check, codec
MAX_SEGMENTS = 1024  # more than any model's layer count: a bound on what a table may make us parse


def table_len(n: int) -> int:
    """Bytes of the table of ``n`` segments."""
    return TABLE_HEAD.size + n * ENTRY.size


def segment_lengths(segments: Sequence[int] | None, raw_len: int, size: int) -> list[int] | None:
    """The caller's segment lengths, checked (ValueError): positive multiples of the item size,
    at most MAX_SEGMENTS, summing to the payload's length. None or one segment: None (the block
    is written unsegmented, exactly as before segments existed)."""
    if segments is None:
        return None
    try:
        lengths = [operator.index(n) for n in segments]
    except TypeError:
        raise ValueError(f"segments {segments!r} must be a sequence of integers") from None
    if (not lengths or len(lengths) > MAX_SEGMENTS or sum(lengths) != raw_len
            or any(n <= 0 or n % size for n in lengths)):
        raise ValueError(f"segments must be 1..{MAX_SEGMENTS} positive multiples of {size} bytes "
                         f"summing to the payload's {raw_len}, got {lengths[:8]}")
    return None if len(lengths) == 1 else lengths


def encode_segments(codec: str, raw: memoryview, size: int, level: int, lengths: list[int],
                    into: memoryview | None) -> tuple[str, list, int, int, int]:
    """The segmented body of ``raw``: (header codec, parts to join (empty with ``into``), stored
    length, header checksum, header body check). With ``into`` (room for the table and ``raw``
    stored raw) each segment's body is written in place: a raw segment is copied once, from the
    payload. The header codec is ``codec`` unless every segment fell back to raw."""
    pos = table_len(len(lengths))
    entries, parts, start, used = [], [], 0, set()
    for n in lengths:
        seg = raw[start : start + n]
        start += n
        body, kind = compress_body(codec, seg, size, level), codec
        if kind != "raw" and len(body) >= n:
            body, kind = seg, "raw"  # incompressible: do not pay to decompress later
        if into is None:
            stored = body
            parts.append(body)
        else:
            stored = into[pos : pos + len(body)]
            copy_bytes(stored, body)
        digest = xxhash.xxh3_64_intdigest(stored if kind == "raw" else seg)  # raw: the copy, in cache
        check = digest & 0xFFFFFFFF if kind == "raw" else body_check(stored)
        entries.append(ENTRY.pack(n, len(body), digest, check, CODECS[kind]))
        used.add(kind)
        pos += len(body)
    table = b"".join((TABLE_HEAD.pack(len(lengths)), *entries))
    if into is None:
        parts.insert(0, table)
    else:
        into[: len(table)] = table
    head_codec = codec if used != {"raw"} else "raw"
    return head_codec, parts, pos, xxhash.xxh3_64_intdigest(table), xxhash.xxh32_intdigest(table)


class BlockSegments:
    """A stored block opened for reading a segment at a time. ``header``: the validated
    BlockHeader; ``bounds``: ``(raw_start, raw_end)`` of each segment in the payload;
    ``raw_len``: the payload's length; ``decode(j, out)``: segment j into ``out``."""

    __slots__ = ("header", "bounds", "raw_len", "_body", "_size", "_segs")

    def __init__(self, header: Any, body: memoryview, size: int, segs: list[tuple]) -> None:
        self.header = header
        self.raw_len: int = header.raw_len
        self.bounds: list[tuple[int, int]] = [(s[1], s[2]) for s in segs]
        self._body, self._size, self._segs = body, size, segs

    def __len__(self) -> int:
        return len(self._segs)

    def stored_ranges(self) -> list[tuple[int, int]]:
        """``(start, end)`` of each segment's stored body in the block's body."""
        return [(s[3], s[4]) for s in self._segs]

    def span(self, j: int) -> tuple[int, int]:
        """``(start, end)`` of segment ``j``'s stored bytes in the stored block (header
        included): what a reader has read ahead before it decodes that segment."""
        _, _, _, lo, hi, _, _ = self._segs[j]
        return HEADER_BYTES + lo, HEADER_BYTES + hi

    def held(self, j: int) -> bool:
        """Whether segment ``j``'s stored bytes are among those the block was opened from (all
        of them, unless it was opened from its head alone)."""
        return self._segs[j][4] <= len(self._body)

    def in_place(self, j: int) -> bool:
        """Whether segment ``j``'s stored bytes are its payload (a raw segment of a plain block):
        a reader reads them straight into the segment's place and :meth:`check_in_place` them."""
        return self._segs[j][0] == "raw"

    def check_in_place(self, j: int, out) -> None:
        """Segment ``j`` (:meth:`in_place`), read straight into ``out``, checked there: on a
        failed check ``out`` is cleared and CorruptBlock raised."""
        dst = self._dst(j, out)
        if not self.in_place(j):
            raise ValueError(f"segment {j} is not stored as its payload")
        if xxhash.xxh3_64_intdigest(dst) != self._segs[j][5]:
            clear(dst)
            raise self._error(j, CorruptBlock("payload checksum mismatch"))

    def decode(self, j: int, out, stored=None) -> memoryview:
        """Validate segment ``j`` and write exactly its raw bytes into ``out`` (a writable buffer
        of exactly that segment's length: ValueError otherwise); a view of ``out``. Its stored
        check is verified before anything is decompressed or copied, its payload hash after: on
        any failure ``out`` is cleared and CorruptBlock raised (whatever went wrong inside).
        ``stored``: the segment's stored bytes (the :meth:`span` of the block), read by the
        caller, where the block was opened from its head alone."""
        dst = self._dst(j, out)
        try:
            try:
                self._fill(j, self._check(j, stored), dst)
            except BaseException:
                clear(dst)  # nothing decoded from a bad segment stays in out
                raise
        except Exception as exc:  # zstd, numpy, MemoryError, ...: the stored bytes caused it
            raise self._error(j, exc) from None
        return dst

    def _dst(self, j: int, out) -> memoryview:
        if not 0 <= j < len(self._segs):
            raise IndexError(f"segment {j} of a block of {len(self._segs)}")
        dst = memoryview(out).cast("B")
        start, end = self.bounds[j]
        if len(dst) != end - start:
            raise ValueError(f"output buffer has {len(dst)} bytes, segment {j} needs {end - start}")
        return dst

    def decode_all(self, dst: memoryview | None) -> memoryview:
        """Every segment into ``dst`` (exactly the raw length; allocated once segment 0 passed
        its checks when None, so a lying first frame costs no allocation). A failure after a
        byte was written clears ``dst``; one before leaves it untouched."""
        j = 0
        try:
            parts = self._check(0)
            if dst is None:
                dst = memoryview(bytearray(self.raw_len))
            try:
                for j, (start, end) in enumerate(self.bounds):
                    self._fill(j, parts if j == 0 else self._check(j), dst[start:end])
            except BaseException:
                clear(dst)
                raise
        except Exception as exc:
            raise self._error(j, exc) from None
        return dst

    def _check(self, j: int, stored=None):
        """Segment j's body (``stored``, else the block's own bytes) checked before use: stored
        check, framing (declared sizes), and for a raw body its payload hash; the parts to
        decompress."""
        codec, start, end, lo, hi, digest, check = self._segs[j]
        if stored is None:
            stored = self._body[lo:hi]
        else:
            stored = memoryview(stored).cast("B")
            if len(stored) != hi - lo:
                raise ValueError(f"segment {j} is {hi - lo} stored bytes, {len(stored)} given")
        if codec != "raw" and body_check(stored) != check:
            raise CorruptBlock("stored body checksum mismatch")
        parts = body_parts(codec, self._size, end - start, stored)  # before allocating anything
        if codec == "raw" and xxhash.xxh3_64_intdigest(stored) != digest:
            raise CorruptBlock("payload checksum mismatch")
        return parts

    def _fill(self, j: int, parts, dst: memoryview) -> None:
        codec, start, end, _, _, digest, _ = self._segs[j]
        decompress_body(codec, self._size, end - start, parts, dst)
        if codec != "raw" and xxhash.xxh3_64_intdigest(dst) != digest:
            raise CorruptBlock("payload checksum mismatch")

    def _error(self, j: int, exc: Exception) -> CorruptBlock:
        """``exc`` as a CorruptBlock naming segment ``j`` (of a segmented block)."""
        err = exc if isinstance(exc, CorruptBlock) else undecodable(exc)
        return CorruptBlock(f"segment {j}: {err.detail}", reason=err.reason) if len(self._segs) > 1 else err


def open_segments(header: Any, body: memoryview, size: int, segmented: bool,
                  body_len: int | None = None) -> BlockSegments:
    """``body`` (of a block whose ``header`` was validated) as segments, its table validated
    completely (CorruptBlock) without touching a segment body. ``body_len``: the whole body's
    length where ``body`` is its first bytes (at least :func:`head_len` of them)."""
    body_len = len(body) if body_len is None else body_len
    if not segmented:
        one = (header.codec, 0, header.raw_len, 0, body_len, header.checksum, header.body_check)
        return BlockSegments(header, body, size, [one])
    return BlockSegments(header, body, size, read_table(header, body, size, body_len))


def head_len(body: memoryview) -> int:
    """Bytes of a segmented body's head (its table) given its first bytes: the table's length
    once its count is among them, else the count's. A count out of bounds: CorruptBlock."""
    if len(body) < TABLE_HEAD.size:
        return TABLE_HEAD.size
    (n,) = TABLE_HEAD.unpack_from(body)
    if not 2 <= n <= MAX_SEGMENTS:
        raise CorruptBlock(f"segment table declares {n} segments (2..{MAX_SEGMENTS})")
    return table_len(n)


def check_body(header: Any, size: int, with_room: bool = True) -> None:
    """The stored length of a plain block's body against its header (CorruptBlock): a
    segmented body holds a table of at least two segments of at least an item each, a raw body
    exactly the payload, and (``with_room``) no body more raw bytes than its codec can make."""
    if header.segmented:
        if header.stored_len < table_len(2) or header.raw_len < 2 * size:
            raise CorruptBlock(f"segmented block of {header.stored_len} stored / {header.raw_len} raw bytes")
    elif header.codec == "raw" and header.stored_len != header.raw_len:
        raise CorruptBlock("raw body length differs from raw length")
    # a segmented body holds at most this much too: its segments are raw or of this codec
    if with_room and header.raw_len > room(header.codec, size, header.stored_len):
        raise CorruptBlock(f"block declares {header.raw_len} raw bytes, more than a {header.codec} body "
                           f"of {header.stored_len} bytes can hold")


def read_table(header: Any, body: memoryview, size: int, body_len: int | None = None) -> list[tuple]:
    """The validated segment table at the start of ``body`` (``body_len``: the whole body's
    length when ``body`` holds only the table)."""
    body_len = len(body) if body_len is None else body_len
    if len(body) < TABLE_HEAD.size:
        raise CorruptBlock("truncated segment table")
    (n,) = TABLE_HEAD.unpack_from(body)
    if not 2 <= n <= MAX_SEGMENTS or table_len(n) > len(body) or n * size > header.raw_len:
        raise CorruptBlock(f"segment table declares {n} segments (2..{MAX_SEGMENTS} that fit a "
                           f"{body_len}-byte body of {header.raw_len} raw bytes)")
    table = body[: table_len(n)]
    if (xxhash.xxh3_64_intdigest(table) != header.checksum
            or xxhash.xxh32_intdigest(table) != header.body_check):
        raise CorruptBlock("segment table checksum mismatch")
    segs, raw_at, stored_at, kinds = [], 0, len(table), set()
    for j, (raw_len, stored_len, digest, check, code) in enumerate(ENTRY.iter_unpack(table[TABLE_HEAD.size :])):
        codec = CODEC_NAMES.get(code)
        if codec not in ("raw", header.codec):  # the header codec is zstd+shuffle, zstd or raw
            raise CorruptBlock(f"segment {j} has codec {code} in a {header.codec} block")
        if raw_len == 0 or raw_len % size or raw_len > room(codec, size, stored_len):
            raise CorruptBlock(f"segment {j} declares {raw_len} raw bytes in a {stored_len}-byte "
                               f"{codec} body (items of {size} bytes)")
        if codec == "raw" and (stored_len != raw_len or check != digest & 0xFFFFFFFF):
            raise CorruptBlock(f"segment {j}: a raw body of {stored_len} bytes for {raw_len} raw "
                               "bytes, or a check other than its payload hash")
        segs.append((codec, raw_at, raw_at + raw_len, stored_at, stored_at + stored_len, digest, check))
        raw_at, stored_at = raw_at + raw_len, stored_at + stored_len
        kinds.add(codec)
        if raw_at > header.raw_len or stored_at > body_len:
            break  # refused below, before a later entry's sizes are looked at
    if raw_at != header.raw_len or stored_at != body_len:
        raise CorruptBlock(f"segment table covers {raw_at} raw / {stored_at} stored bytes, the block "
                           f"has {header.raw_len} / {body_len}")
    if header.codec != "raw" and kinds == {"raw"}:
        raise CorruptBlock(f"{header.codec} block whose segments are all raw (never written)")
    return segs
