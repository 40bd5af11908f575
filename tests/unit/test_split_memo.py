"""The split check's memo of raw layouts (tiered_kv.store.codec_split): a block of a layout that
passed every check once is still checked for each of its own fields; a lie anywhere in a block,
head or payload, is refused with the same error whether its layout is remembered or not, and
leaves nothing in the destination; another reader's arguments, a compressed or sealed block, or
a table of another shape get every check; the memo stays bounded."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash

from tiered_kv.errors import CorruptBlock
from tiered_kv.store import codec_split
from tiered_kv.store.codec import HEADER, HEADER_BYTES, BlockCodec, BlockLayout
from tiered_kv.store.codec_body import CODEC_NAMES
from tiered_kv.store.codec_header import DTYPE_NAMES, MAX_NDIM, pack_header
from tiered_kv.store.codec_segments import ENTRY, TABLE_HEAD
from tiered_kv.store.codec_split import check_split

NS = bytes(range(16))
OTHER_NS = bytes(range(1, 17))
LAYOUT = BlockLayout("bfloat16", (4, 2, 16, 2, 32))  # 16 KiB
FRAMES = [LAYOUT.raw_len // 4] * 4  # four layer groups: a head with a segment table
KEYS = [bytes([i]) * 16 for i in range(1, 5)]


def block(key: bytes, seed: int = 0, segments=FRAMES, codec: str = "raw") -> bytes:
    rng = np.random.default_rng(seed)
    payload = rng.integers(0, 255 if codec == "raw" else 3, LAYOUT.raw_len, dtype=np.uint8)
    return bytes(BlockCodec(codec).encode(payload, dtype="bfloat16", shape=LAYOUT.shape, namespace=NS,
                                          key=key, segments=segments))


def head_of(blob: bytes) -> int:
    return len(blob) - LAYOUT.raw_len


def resealed(blob: bytes, table: bytes, payload: bytes | None = None) -> bytes:
    """``blob`` with its segment table replaced by ``table`` (and its payload by ``payload``),
    the header's table checksums and its own xxh32 made to match again: a lie that no plain
    hash catches, only the checks of what the table says."""
    (magic, version, codec, dtype, level, ndim, flags, *rest) = HEADER.unpack(blob[:HEADER_BYTES])
    dims, (ns, key, raw_len, stored_len, _, _, created, _) = rest[:MAX_NDIM], rest[MAX_NDIM:]
    head = pack_header(CODEC_NAMES[codec], DTYPE_NAMES[dtype], level, dims[:ndim], ns, key, raw_len, stored_len,
                       xxhash.xxh3_64_intdigest(table), xxhash.xxh32_intdigest(table), created, flags)
    rest_of_body = blob[HEADER_BYTES + len(table):] if payload is None else payload
    return head + table + rest_of_body


def table_fields(blob: bytes) -> list:
    n = struct.unpack_from("<I", blob, HEADER_BYTES)[0]
    return list(struct.unpack_from(TABLE_HEAD.format + ENTRY.format[1:] * n, blob, HEADER_BYTES))


def table_of(fields: list) -> bytes:
    n = (len(fields) - 1) // 5
    return struct.pack(TABLE_HEAD.format + ENTRY.format[1:] * n, *fields)


def split(blob: bytes, key: bytes, head_len: int | None = None, **kwargs):
    """check_split of ``blob`` read in two pieces: (its outcome or the error's type and text,
    the destination afterwards)."""
    n = head_of(blob) if head_len is None else head_len
    out = bytearray(blob[n:])
    args = dict(namespace=NS, key=key, expect=LAYOUT, sealing=None) | kwargs
    try:
        return check_split(blob[:n], out, **args), bytes(out)
    except CorruptBlock as exc:
        return (type(exc), exc.reason, str(exc)), bytes(out)


@pytest.fixture(autouse=True)
def fresh_memo():
    codec_split._known.clear()
    yield
    codec_split._known.clear()


@pytest.fixture
def full_checks(monkeypatch):
    calls = []
    real = codec_split._check_all
    monkeypatch.setattr(codec_split, "_check_all", lambda *a: calls.append(a[3]) or real(*a))
    return calls


@pytest.mark.parametrize("segments", [FRAMES, None], ids=["framed", "one-frame"])
def test_a_block_of_a_remembered_layout_is_checked_for_its_own_fields_only(full_checks, segments):
    a, b = block(KEYS[0], 1, segments), block(KEYS[1], 2, segments)
    assert head_of(a) > HEADER_BYTES if segments else head_of(a) == HEADER_BYTES
    assert split(a, KEYS[0]) == (True, a[head_of(a):])
    assert codec_split._known and full_checks == [KEYS[0]], "a valid raw layout is remembered"
    assert split(b, KEYS[1]) == (True, b[head_of(b):])
    assert full_checks == [KEYS[0]], "a block of that layout is not checked in full"
    # its key is still checked, in full (the error a first read gives)
    outcome, out = split(b, KEYS[0])
    assert outcome[0] is CorruptBlock and "carries key" in outcome[2] and not any(out)
    assert full_checks == [KEYS[0], KEYS[0]]


def test_every_lie_in_a_block_is_refused_with_the_same_error_remembered_or_not():
    good = block(KEYS[1], seed=3)
    n = head_of(good)
    lies = []
    for pos in [*range(n), *(n + f * FRAMES[0] + d for f in range(4) for d in (0, 777, FRAMES[0] - 1))]:
        for mask in (0x01, 0x80):
            bad = bytearray(good)
            bad[pos] ^= mask
            lies.append(bytes(bad))
    first = []
    for lie in lies:
        codec_split._known.clear()
        first.append(split(lie, KEYS[1]))
    assert split(block(KEYS[0]), KEYS[0])[0] is True  # remember the layout
    assert codec_split._known
    remembered = [split(lie, KEYS[1]) for lie in lies]
    assert remembered == first
    for outcome, out in first:
        assert outcome is not True and issubclass(outcome[0], CorruptBlock), "every lie is refused"
        assert not any(out), "a byte of a refused block stayed in the destination"


def test_a_layout_remembered_for_one_reader_is_checked_again_for_another(full_checks):
    a, b = block(KEYS[0]), block(KEYS[1], seed=5)
    assert split(a, KEYS[0])[0] is True
    outcome, _ = split(b, KEYS[1], namespace=OTHER_NS)
    assert outcome[0].__name__ == "NamespaceMismatch"
    outcome, _ = split(b, KEYS[1], expect=BlockLayout("bfloat16", (2, 2, 16, 2, 64)))
    assert "the namespace's block is" in outcome[2]
    outcome, _ = split(b, KEYS[1], sealing=object())
    assert outcome[1] == "unencrypted"
    assert split(b, KEYS[1], expect=BlockLayout("bfloat16", LAYOUT.shape))[0] is True  # equal, another object
    assert len(full_checks) == 5


def test_compressed_blocks_and_other_tables_are_not_remembered_and_the_memo_stays_bounded(full_checks):
    compressed = block(KEYS[0], codec="zstd")
    assert split(compressed, KEYS[0], head_len=HEADER_BYTES)[0] is False  # decoded whole by the caller
    assert not codec_split._known
    halves = block(KEYS[1], segments=[LAYOUT.raw_len // 2] * 2)
    assert split(block(KEYS[0]), KEYS[0])[0] is True and split(halves, KEYS[1])[0] is True
    assert split(halves, KEYS[1])[0] is True
    assert len(full_checks) == 3 and len(codec_split._known) == 2, "one layout each, both remembered"
    raw = block(KEYS[2])
    for _ in range(3 * codec_split.MEMO_ENTRIES):
        assert split(raw, KEYS[2], expect=BlockLayout("bfloat16", LAYOUT.shape))[0] is True  # a new reader each
    assert 0 < len(codec_split._known) <= codec_split.MEMO_ENTRIES


def test_resealed_lies_in_the_segment_table_are_refused_with_the_same_error_remembered_or_not():
    good = block(KEYS[1], seed=4)
    n_head, fields = head_of(good), table_fields(good)
    payload = bytearray(good[n_head:])
    lies = []  # (what, blob, the head length the medium would split it at)
    for count in (1, 2, 3, 5, 8):
        lies.append((f"count {count}", resealed(good, table_of([count, *fields[1:]])), n_head))
    for j, (field, delta) in enumerate([(1, 2), (2, 2), (1, -2), (2, -2)]):  # raw / stored length moved
        forged = list(fields)
        forged[field + 5 * (j % 2)] += delta
        forged[field + 5 * (1 - j % 2)] -= delta
        lies.append((f"lengths {j}", resealed(good, table_of(forged)), n_head))
    zstd = next(code for code, name in CODEC_NAMES.items() if name == "zstd")
    forged = list(fields)
    forged[5] = zstd
    lies.append(("codec", resealed(good, table_of(forged)), n_head))
    forged = list(fields)
    forged[4] ^= 1  # a raw segment's check that is not its digest's low bits
    lies.append(("check", resealed(good, table_of(forged)), n_head))
    forged = list(fields)
    forged[3] ^= 1 << 40  # a digest whose low bits still match its check, payload unchanged
    lies.append(("digest", resealed(good, table_of(forged)), n_head))
    # a digest and check that match a changed payload: a consistent block, accepted either way
    payload[5] ^= 0xFF
    forged = list(fields)
    forged[3] = xxhash.xxh3_64_intdigest(bytes(payload[: FRAMES[0]]))
    forged[4] = forged[3] & 0xFFFFFFFF
    lies.append(("resealed payload", resealed(good, table_of(forged), bytes(payload)), n_head))

    def outcomes() -> list:
        return [split(blob, KEYS[1], head_len=n) for _, blob, n in lies]

    first = []
    for _, blob, n in lies:
        codec_split._known.clear()
        first.append(split(blob, KEYS[1], head_len=n))
    assert split(block(KEYS[0]), KEYS[0])[0] is True and codec_split._known  # remember the layout
    assert outcomes() == first
    for (what, _, _), (outcome, out) in zip(lies, first):
        if what == "resealed payload":
            assert outcome is True, "hashes are checks, not signatures: sealing is what stops a forger"
        else:
            assert outcome is not True and issubclass(outcome[0], CorruptBlock), what
            assert not any(out), what


def test_a_destination_of_another_length_is_refused_remembered_or_not():
    good = block(KEYS[1], seed=6)
    n = head_of(good)
    assert split(block(KEYS[0]), KEYS[0])[0] is True  # remember the layout
    for extra in (-2, 2):
        out = bytearray(len(good) - n + extra)
        out[: len(good) - n] = good[n:][: len(out)]
        with pytest.raises(CorruptBlock):
            check_split(good[:n], out, namespace=NS, key=KEYS[1], expect=LAYOUT, sealing=None)
        assert not any(out)
