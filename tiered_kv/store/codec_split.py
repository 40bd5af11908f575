"""Checking a raw block read in two pieces: its head (the header, and the segment table of a
segmented block) into a small buffer and the rest straight into the caller's destination. A
plain raw block's bytes after its head are its payload in order (a segmented one's raw segments
follow its table back to back), so a medium that can read a value in pieces
(:meth:`storage_backends.base.Backend.visit_split`) lands the payload where it belongs with the
one copy the read makes, and this checks it there: the header and table as for any block, then
each segment's xxh3-64 over its bytes in the destination. A failed check clears the destination
(no byte of a bad block stays with the caller). No torch here."""

from __future__ import annotations

import xxhash

from tiered_kv.dtypes import ITEMSIZE
from tiered_kv.errors import CorruptBlock
from tiered_kv.store.codec import BlockLayout
from tiered_kv.store.codec_body import clear, undecodable
from tiered_kv.store.codec_header import HEADER_BYTES
from tiered_kv.store.codec_header_check import read_header
from tiered_kv.store.codec_sealed import Sealing
from tiered_kv.store.codec_segments import read_table

MAX_HEAD = 64 << 10  # a head longer than this is no raw block's (header and the largest table fit)


def check_split(head, out, *, namespace: bytes, key: bytes, expect: BlockLayout | None,
                sealing: Sealing | None) -> bool:
    """Whether ``head`` + ``out`` is a valid plain raw block of ``namespace``/``key`` whose
    payload is now in ``out``. False (``out`` holds bytes to overwrite) when the block is not
    laid out that way (compressed, sealed): the caller decodes the whole block instead.
    CorruptBlock when a check fails; ``out`` is then cleared."""
    head, dst = memoryview(head).cast("B"), memoryview(out).cast("B")
    try:
        header = read_header(head, namespace=namespace, key=key, expect=expect,
                             total_len=len(head) + len(dst))
        if header.sealed or header.codec != "raw":
            return False
        if sealing is not None:
            raise CorruptBlock("a plain block where blocks are encrypted", reason="unencrypted")
        if header.raw_len != len(dst):
            raise CorruptBlock(f"block of {header.raw_len} raw bytes read into {len(dst)}")
        if not header.segmented:
            if len(head) != HEADER_BYTES:
                return False
            segments = [(0, header.raw_len, header.checksum)]
        else:
            table = head[HEADER_BYTES:]
            rows = read_table(header, table, ITEMSIZE[header.dtype], body_len=header.stored_len)
            if rows[0][3] != len(table):  # the first segment's body starts where the table ends
                return False
            segments = [(start, end, digest) for _, start, end, _, _, digest, _ in rows]
        for start, end, digest in segments:
            if xxhash.xxh3_64_intdigest(dst[start:end]) != digest:
                raise CorruptBlock("payload checksum mismatch")
        return True
    except CorruptBlock:
        clear(dst)
        raise
    except Exception as exc:  # struct, ...: the stored bytes caused it
        clear(dst)
        raise undecodable(exc) from None
