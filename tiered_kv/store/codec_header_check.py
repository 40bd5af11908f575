"""Validating a stored block's header (:func:`read_header`, which
:meth:`tiered_kv.store.codec.BlockCodec.read_header` calls), with a memo of the fields every
block of a namespace shares.

A header's fields fall in two kinds. Its *fixed* fields (magic, version, codec, dtype, level,
shape, flags, namespace, raw and stored length) are the same for every raw block of one
namespace, and all but three of the checks (magic, version, known codes, shape against raw
length, body length against codec, the namespace and the expected layout, the raw-length
bounds) look at them and at the reader's arguments alone. Its *own* fields (key, checksums,
created time, the header's xxh32) differ per block. So, for raw bodies (a compressed body's
length is its own), the outcome of those checks is remembered per (fixed bytes, reader's
arguments) that passed them, and a header whose fixed bytes were validated before under the
same arguments gets only the three checks of its own fields: its xxh32 (which covers every
byte, fixed ones too), its length against what was read, and its key. Nothing that failed is
remembered, and the checks run in the same order either way, so a bad header is refused with
the same error. A 64 KiB block's header check took 2.9 us; remembered, 1.8 us (most of it the
unpacking and the record every read builds).

No torch here."""

from __future__ import annotations

import struct
from math import prod

import xxhash

from tiered_kv.dtypes import ITEMSIZE
from tiered_kv.errors import CorruptBlock, NamespaceMismatch
from tiered_kv.store.codec_body import CODEC_NAMES, room
from tiered_kv.store.codec_header import (
    DTYPE_NAMES,
    FLAGS,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    MAX_NDIM,
    SEALED,
    VERSION,
    BlockHeader,
)
from tiered_kv.store.codec_sealed import MIN_SEALED, most_stored
from tiered_kv.store.codec_segments import check_body

FIXED_BYTES = 52  # magic .. namespace: the header's leading fixed fields (the key follows)
OWN = struct.Struct("<16sQQQIdI")  # key, raw_len, stored_len, checksum, body_check, created, xxh32
assert FIXED_BYTES + OWN.size == HEADER_BYTES
MEMO_ENTRIES = 256  # fixed parts remembered (one per namespace and reader in practice); then forgotten

# (fixed bytes, raw_len, stored_len, namespace, id(expect), max_raw) -> the header's fixed fields,
# decoded, and ``expect`` itself: (codec, dtype, level, shape, namespace, version, flags,
# expect). An entry holds its layout, so no other layout can have that id while it lives (a
# layout's own hash is a Python call: it cost a third of a remembered read). Shared by every thread (a
# dict's get and set are atomic); only headers that passed every check get here.
_valid: dict[tuple, tuple] = {}


def read_header(blob, *, namespace: bytes | None = None, key: bytes | None = None, expect=None,
                max_raw: int | None = None, total_len: int | None = None) -> BlockHeader:
    """Parse and validate the header of ``blob``; see
    :meth:`tiered_kv.store.codec.BlockCodec.read_header` (``expect``: a ``BlockLayout``)."""
    view = memoryview(blob).cast("B")
    if len(view) < HEADER_BYTES:
        raise CorruptBlock(f"truncated header: {len(view)} < {HEADER_BYTES} bytes")
    head = view[:HEADER_BYTES]
    k, raw_len, stored_len, checksum, body_check, created, check = OWN.unpack_from(head, FIXED_BYTES)
    if namespace is not None and type(namespace) is not bytes:  # (a memo key must hash)
        namespace = bytes(namespace)
    memo = (bytes(head[:FIXED_BYTES]), raw_len, stored_len, namespace, id(expect), max_raw)
    fixed = _valid.get(memo)
    if fixed is None or fixed[-1] is not expect:
        length = len(view) if total_len is None else total_len
        header = _check_all(head, namespace, key, expect, max_raw, length)
        if header.codec == "raw":  # a compressed body's length is its own: nothing shared to remember
            if len(_valid) >= MEMO_ENTRIES:
                _valid.clear()
            _valid[memo] = (header.codec, header.dtype, header.level, header.shape, header.namespace,
                            header.version, header.flags, expect)
        return header
    _check_sum(head, check)
    _check_length(len(view) if total_len is None else total_len, stored_len)
    _check_key(k, key)
    codec, dtype, level, shape, ns, version, flags, _ = fixed
    return BlockHeader(codec, dtype, level, shape, ns, k, raw_len, stored_len, checksum, body_check,
                       created, version, flags)


def _check_all(head: memoryview, namespace, key, expect, max_raw, length: int) -> BlockHeader:
    """Every check of the header ``head`` of a block of ``length`` bytes, in order."""
    (magic, version, codec, dtype, level, ndim, flags, *rest) = HEADER.unpack(head)
    dims, (ns, k, raw_len, stored_len, checksum, body_check, created, check) = (
        rest[:MAX_NDIM], rest[MAX_NDIM:])
    if magic != MAGIC:
        raise CorruptBlock(f"bad magic {bytes(magic)!r}")
    _check_sum(head, check)
    if version != VERSION:
        raise CorruptBlock(f"unsupported format version {version}")
    if codec not in CODEC_NAMES or dtype not in DTYPE_NAMES or flags & ~FLAGS:
        raise CorruptBlock(f"unknown codec {codec} / dtype {dtype} / flags {flags}")
    if not 1 <= ndim <= MAX_NDIM or 0 in dims[:ndim] or any(dims[ndim:]):
        raise CorruptBlock(f"bad shape {dims} with ndim {ndim}")
    shape = tuple(dims[:ndim])
    dtype_name = DTYPE_NAMES[dtype]
    if prod(shape) * ITEMSIZE[dtype_name] != raw_len:
        raise CorruptBlock(f"raw length {raw_len} does not match shape {shape} x {dtype_name}")
    _check_length(length, stored_len)
    codec_name, size = CODEC_NAMES[codec], ITEMSIZE[dtype_name]
    if stored_len > most_stored(raw_len, size, bool(flags & SEALED)):
        raise CorruptBlock(f"block declares {stored_len} stored bytes, more than a block of {raw_len} "
                           "raw bytes is ever stored in")
    header = BlockHeader(codec_name, dtype_name, level, shape, ns, k, raw_len,
                         stored_len, checksum, body_check, created, version, flags)
    if header.sealed:  # the plain block's body is checked once decrypted
        if stored_len < MIN_SEALED:
            raise CorruptBlock(f"sealed block of {stored_len} stored bytes")
    else:
        check_body(header, size, with_room=False)
    if namespace is not None and ns != namespace:
        raise NamespaceMismatch(f"block of namespace {ns.hex()} read under {namespace.hex()}")
    _check_key(k, key)
    if expect is not None and (dtype_name != expect.dtype or shape != expect.shape):
        raise CorruptBlock(f"block declares {dtype_name} {list(shape)} ({raw_len} bytes), "
                           f"the namespace's block is {expect.describe()}")
    if codec_name == "zstd+shuffle" and size == 1:
        raise CorruptBlock("zstd+shuffle declared for a 1-byte dtype (never written)")
    # a segmented body holds at most this much too: its segments are raw or of this codec
    if raw_len > room(codec_name, size, stored_len):
        raise CorruptBlock(f"block declares {raw_len} raw bytes, more than a {codec_name} body "
                           f"of {stored_len} bytes can hold")
    if expect is None and max_raw is not None and raw_len > max_raw:
        raise CorruptBlock(f"block declares {raw_len} raw bytes, over the {max_raw}-byte limit "
                           "for a block of unknown namespace")
    return header


# -- the checks of a header's own fields (both paths) --------------------------------------------
def _check_sum(head: memoryview, check: int) -> None:
    if xxhash.xxh32_intdigest(head[:-4]) != check:
        raise CorruptBlock("header checksum mismatch")


def _check_length(length: int, stored_len: int) -> None:
    if length != HEADER_BYTES + stored_len:
        raise CorruptBlock(f"stored length {stored_len} but body has {length - HEADER_BYTES} bytes")


def _check_key(k: bytes, key: bytes | None) -> None:
    if key is not None and k != key:
        raise CorruptBlock(f"block carries key {k.hex()} but was stored under {key.hex()}")
