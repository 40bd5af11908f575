"""Checking a raw block read in two pieces: its head (the header, and the segment table of a
segmented block) into a small buffer and the rest straight into the caller's destination. A
plain raw block's bytes after its head are its payload in order (a segmented one's raw segments
follow its table back to back), so a medium that can read a value in pieces
(:meth:`storage_backends.base.Backend.visit_split`) lands the payload where it belongs with the
one copy the read makes, and this checks it there: the header and table as for any block, then
each segment's xxh3-64 over its bytes in the destination. A failed check clears the destination
(no byte of a bad block stays with the caller). No torch here.

Every raw block of one namespace has the same *layout*: its header's fixed fields, its raw and
stored lengths, and its table's shape (the count, and each segment's raw length, stored length
and codec). Only its own fields differ: key, checksums, created time, the header's xxh32, each
segment's digest and check. So a layout that passed every check once is remembered per
(fixed header bytes, lengths, namespace, reader's layout), and a block of a remembered layout
gets only the checks of its own fields: the header's xxh32 and key, the table's two checksums
and every entry's shape against the layout, each raw segment's check against its digest, and
the digests against its payload. Anything else (a field that differs, a failed check) sends the
block through every check in order, which refuses it with the error a first read gives. A 2 MiB
block of 8 segments took 58 us to check in full here and takes 50 remembered, 45 of either the
hashing of its segments."""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

from tiered_kv.dtypes import ITEMSIZE
from tiered_kv.errors import CorruptBlock
from tiered_kv.store.codec import BlockLayout
from tiered_kv.store.codec_body import clear, undecodable
from tiered_kv.store.codec_header import HEADER_BYTES
from tiered_kv.store.codec_header_check import FIXED_BYTES, OWN, read_header
from tiered_kv.store.codec_sealed import Sealing
from tiered_kv.store.codec_segments import ENTRY, TABLE_HEAD, read_table

MEMO_ENTRIES = 64  # layouts remembered (one per namespace and reader in practice); then forgotten
_LOW32 = 0xFFFFFFFF


class _Layout(NamedTuple):
    """What every block of one remembered layout shares (all checked once, in full)."""

    expect: object  # the reader's layout the block was checked against (kept: its id is in the key)
    table: struct.Struct | None  # the whole segment table; None: an unsegmented block
    rows: tuple  # the table's count, and its entries' raw lengths, stored lengths and codecs
    frames: tuple[tuple[int, int], ...]  # each segment's payload bytes in the destination


# (fixed header bytes, raw_len, stored_len, head length, namespace, id(expect)) -> _Layout; shared by
# every thread (a dict's get and set are atomic); only layouts of blocks that passed every check
_known: dict[tuple, _Layout] = {}


def check_split(head, out, *, namespace: bytes, key: bytes, expect: BlockLayout | None,
                sealing: Sealing | None) -> bool:
    """Whether ``head`` + ``out`` is a valid plain raw block of ``namespace``/``key`` whose
    payload is now in ``out``. False (``out`` holds bytes to overwrite) when the block is not
    laid out that way (compressed, sealed): the caller decodes the whole block instead.
    CorruptBlock when a check fails; ``out`` is then cleared."""
    head, dst = memoryview(head).cast("B"), memoryview(out).cast("B")
    if len(head) < HEADER_BYTES:  # a compressed or sealed block a few bytes longer than its payload
        return False  # (its header runs into ``out``): not head + payload, judged whole
    memo = None
    if sealing is None and type(namespace) is bytes:  # (a memo key must hash)
        own = OWN.unpack_from(head, FIXED_BYTES)
        memo = (bytes(head[:FIXED_BYTES]), own[1], own[2], len(head), namespace, id(expect))
        layout = _known.get(memo)
        if layout is not None and layout.expect is expect and len(dst) == own[1] \
                and _own_fields_hold(layout, head, dst, own, key):
            return True
    layout = _check_all(head, dst, namespace, key, expect, sealing)
    if layout is not None and memo is not None:  # (valid: every check passed)
        if len(_known) >= MEMO_ENTRIES:
            _known.clear()
        _known[memo] = layout._replace(expect=expect)
    return layout is not None


def _own_fields_hold(layout: _Layout, head: memoryview, dst: memoryview, own: tuple, key: bytes) -> bool:
    """Whether a block of a remembered layout passes the checks of its own fields (False: it is
    checked in full, which says what is wrong)."""
    k, _, _, checksum, body_check, _, check = own
    if k != key or xxhash.xxh32_intdigest(head[: HEADER_BYTES - 4]) != check:
        return False
    if layout.table is None:
        digests = (checksum,)
    else:
        table = head[HEADER_BYTES:]
        fields = layout.table.unpack(table)
        digests, checks = fields[3::5], fields[4::5]
        if ((fields[0], fields[1::5], fields[2::5], fields[5::5]) != layout.rows
                or xxhash.xxh3_64_intdigest(table) != checksum or xxhash.xxh32_intdigest(table) != body_check
                or list(checks) != [d & _LOW32 for d in digests]):
            return False
    # (list comprehensions: a generator's resume per segment was a tenth of this check's Python)
    return [xxhash.xxh3_64_intdigest(dst[start:end]) for start, end in layout.frames] == list(digests)


def _check_all(head: memoryview, dst: memoryview, namespace: bytes, key: bytes, expect, sealing) -> _Layout | None:
    """Every check, in order: the block's layout when it is a valid plain raw block read in two
    pieces, None when it is not laid out that way; CorruptBlock (``dst`` cleared) when a check
    fails."""
    try:
        header = read_header(head, namespace=namespace, key=key, expect=expect,
                             total_len=len(head) + len(dst))
        if header.sealed or header.codec != "raw":
            return None
        if sealing is not None:
            raise CorruptBlock("a plain block where blocks are encrypted", reason="unencrypted")
        if header.raw_len != len(dst):
            raise CorruptBlock(f"block of {header.raw_len} raw bytes read into {len(dst)}")
        if not header.segmented:
            if len(head) != HEADER_BYTES:
                return None
            layout, digests = _Layout(None, None, (), ((0, header.raw_len),)), [header.checksum]
        else:
            table = head[HEADER_BYTES:]
            rows = read_table(header, table, ITEMSIZE[header.dtype], body_len=header.stored_len)
            if rows[0][3] != len(table):  # the first segment's body starts where the table ends
                return None
            layout, digests = _table_layout(table, rows), [digest for *_, digest, _ in rows]
        for (start, end), digest in zip(layout.frames, digests):
            if xxhash.xxh3_64_intdigest(dst[start:end]) != digest:
                raise CorruptBlock("payload checksum mismatch")
        return layout
    except CorruptBlock:
        clear(dst)
        raise
    except Exception as exc:  # struct, ...: the stored bytes caused it
        clear(dst)
        raise undecodable(exc) from None


def _table_layout(table: memoryview, rows: list[tuple]) -> _Layout:
    """The layout of a raw block's validated table (every segment raw: a raw block's table
    holds no other codec; its size that of ``len(rows)`` entries: its first body starts where
    it ends)."""
    n = len(rows)
    shape = struct.Struct(TABLE_HEAD.format + ENTRY.format[1:] * n)
    fields = shape.unpack(table)
    return _Layout(None, shape, (fields[0], fields[1::5], fields[2::5], fields[5::5]),
                   tuple((start, end) for _, start, end, *_ in rows))
