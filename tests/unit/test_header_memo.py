"""The header check's memo (tiered_kv.store.codec_header_check): a header whose fixed fields
were validated before is still checked for its own fields, is checked again under another
reader's arguments, and is refused with the same error as on a first read."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from tiered_kv.errors import CorruptBlock, NamespaceMismatch
from tiered_kv.store import codec_header_check
from tiered_kv.store.codec import HEADER, HEADER_BYTES, BlockCodec, BlockLayout
from tiered_kv.store.codec_body import CODEC_NAMES
from tiered_kv.store.codec_header import DTYPE_NAMES, MAX_NDIM, pack_header

NS = bytes(range(16))
OTHER_NS = bytes(range(1, 17))
LAYOUT = BlockLayout("bfloat16", (2, 2, 16, 4, 64))
KEYS = [bytes([i]) * 16 for i in range(1, 4)]
OWN_FIELDS = range(52, HEADER_BYTES)  # key .. the header's xxh32: differ per block


def block(key: bytes, seed: int = 0, codec: str = "raw") -> bytes:
    payload = np.random.default_rng(seed).integers(0, 255 if codec == "raw" else 3, LAYOUT.raw_len, dtype=np.uint8)
    return bytes(BlockCodec(codec).encode(payload, dtype="bfloat16", shape=LAYOUT.shape,
                                          namespace=NS, key=key))


def forged(blob: bytes, **fields) -> bytes:
    """``blob`` with header fields replaced and the header's xxh32 made to match again."""
    (magic, version, codec, dtype, level, ndim, flags, *rest) = HEADER.unpack(blob[:HEADER_BYTES])
    dims, (ns, key, raw_len, stored_len, checksum, body_check, created, _) = rest[:MAX_NDIM], rest[MAX_NDIM:]
    values = dict(key=key, checksum=checksum, created=created) | fields
    head = pack_header(CODEC_NAMES[codec], DTYPE_NAMES[dtype], level, dims[:ndim], ns, values["key"], raw_len,
                       stored_len, values["checksum"], body_check, values["created"], flags)
    return head + blob[HEADER_BYTES:]


def refusal(blob: bytes, **kwargs) -> tuple[type, str] | None:
    try:
        BlockCodec.read_header(blob, **kwargs)
    except CorruptBlock as exc:
        return type(exc), str(exc)
    return None


@pytest.fixture(autouse=True)
def fresh_memo():
    codec_header_check._valid.clear()
    yield
    codec_header_check._valid.clear()


def test_a_remembered_header_still_checks_the_key_checksum_and_length_of_each_block(monkeypatch):
    a, b = block(KEYS[0], seed=1), block(KEYS[1], seed=2)
    assert BlockCodec.read_header(a, namespace=NS, key=KEYS[0], expect=LAYOUT).key == KEYS[0]
    assert codec_header_check._valid, "the raw block's fixed fields are remembered"

    # b shares every fixed byte with a: only its own fields are checked now
    full_checks = []
    real = codec_header_check._check_all
    monkeypatch.setattr(codec_header_check, "_check_all", lambda *a: full_checks.append(a) or real(*a))
    header = BlockCodec.read_header(b, namespace=NS, key=KEYS[1], expect=LAYOUT)
    assert full_checks == [], "a header whose fixed fields were validated is not checked in full again"
    assert (header.key, header.raw_len, header.shape) == (KEYS[1], LAYOUT.raw_len, LAYOUT.shape)
    with pytest.raises(CorruptBlock, match="carries key"):
        BlockCodec.read_header(b, namespace=NS, key=KEYS[0], expect=LAYOUT)
    with pytest.raises(CorruptBlock, match="carries key"):  # a forged header claiming b's key, sound xxh32
        BlockCodec.read_header(forged(a, key=KEYS[1]), namespace=NS, key=KEYS[0], expect=LAYOUT)
    flipped = bytearray(b)
    flipped[HEADER_BYTES - 10] ^= 1  # in the checksum field; the header's xxh32 no longer matches
    with pytest.raises(CorruptBlock, match="header checksum"):
        BlockCodec.read_header(bytes(flipped), namespace=NS, key=KEYS[1], expect=LAYOUT)
    with pytest.raises(CorruptBlock, match="stored length"):
        BlockCodec.read_header(b[:-1], namespace=NS, key=KEYS[1], expect=LAYOUT)


def test_a_header_remembered_for_one_reader_is_checked_again_for_another():
    a = block(KEYS[0])
    BlockCodec.read_header(a, namespace=NS, key=KEYS[0], expect=LAYOUT)
    with pytest.raises(NamespaceMismatch):
        BlockCodec.read_header(a, namespace=OTHER_NS, key=KEYS[0], expect=LAYOUT)
    with pytest.raises(CorruptBlock, match="the namespace's block is"):
        BlockCodec.read_header(a, namespace=NS, key=KEYS[0], expect=BlockLayout("bfloat16", (1, 2, 16, 4, 64)))
    with pytest.raises(CorruptBlock, match="over the"):  # a tool that knows no layout, with a lower bound
        BlockCodec.read_header(a, max_raw=LAYOUT.raw_len - 1)
    # an equal layout that is another object: checked in full, and accepted
    assert BlockCodec.read_header(a, namespace=NS, key=KEYS[0],
                                  expect=BlockLayout("bfloat16", LAYOUT.shape)).key == KEYS[0]


def test_every_lie_in_a_blocks_own_fields_is_refused_with_the_same_error_remembered_or_not():
    good = block(KEYS[1], seed=3)
    lies = [good[:-7], good + b"\0", forged(good, key=KEYS[2]), forged(good, checksum=1)[:HEADER_BYTES]]
    for pos in OWN_FIELDS:
        for mask in (0x01, 0x80):
            bad = bytearray(good)
            bad[pos] ^= mask
            lies.append(bytes(bad))
    args = {"namespace": NS, "key": KEYS[1], "expect": LAYOUT}
    first = []
    for lie in lies:
        codec_header_check._valid.clear()
        first.append(refusal(lie, **args))
    BlockCodec.read_header(block(KEYS[0]), namespace=NS, key=KEYS[0], expect=LAYOUT)  # remember the fixed bytes
    remembered = [refusal(lie, **args) for lie in lies]
    assert remembered == first
    assert all(first[:2]) and all(first[4:]), "every damaged header is refused"
    assert first[2] is not None  # the forged key
    assert first[3] is not None  # only the header: the length check refuses it


def test_compressed_blocks_are_not_remembered_and_the_memo_stays_bounded():
    compressed = block(KEYS[0], codec="zstd")
    assert BlockCodec.read_header(compressed, namespace=NS, key=KEYS[0], expect=LAYOUT).codec == "zstd"
    assert not codec_header_check._valid  # each compressed body's length is its own
    raw = block(KEYS[0])
    for i in range(3 * codec_header_check.MEMO_ENTRIES):
        ns = struct.pack("<QQ", i, 7)
        with pytest.raises(NamespaceMismatch):  # each namespace a new memo key; none of them valid
            BlockCodec.read_header(raw, namespace=ns)
        BlockCodec.read_header(raw, max_raw=LAYOUT.raw_len + i)  # each a new, valid reader
    assert 0 < len(codec_header_check._valid) <= codec_header_check.MEMO_ENTRIES
