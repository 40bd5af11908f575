"""Layer-wise reads (tiered_kv.store.layered_reads): a block opened from its head alone, then
each frame read when its pass starts, raw frames straight into their place. What is pinned:
every codec, dtype and framing (sealed too) arrives whole and ready frame by frame; every
flipped byte is caught and the block lost from its frame on, never a byte of it left unchecked;
a read the medium refuses is an ``unreadable`` miss, a value gone is a plain miss, and the
medium's own failure is raised, not blamed on a block."""

from __future__ import annotations

import numpy as np
import pytest

from storage_backends.base import InMemoryRanges
from tests.store.test_codec_segments import KEY, NS, SHAPE, SMALL, kv_bytes, plan
from tiered_kv.dtypes import ITEMSIZE
from tiered_kv.errors import BackendUnavailable, CorruptBlock
from tiered_kv.store.codec import HEADER_BYTES, BlockCodec, BlockLayout
from tiered_kv.store.codec_segments import table_len
from tiered_kv.store.layered_reads import LayeredBlocks
from tiered_kv.store.tenant_cipher import TenantCipher

SEALING = TenantCipher(b"a secret of enough bytes").sealing(b"alice")


class Recorder(InMemoryRanges):
    """The in-memory reader, recording each read (value, start, length, into's buffer) and
    answering ``answers[(i, start)]`` instead where given."""

    def __init__(self, blobs, answers=None) -> None:
        super().__init__([memoryview(b) for b in blobs])
        self.reads, self.answers = [], answers or {}

    def read(self, i, start, into):
        self.reads.append((i, start, memoryview(into).nbytes, memoryview(into).obj))
        answer = self.answers.get((i, start), True)
        if isinstance(answer, Exception):
            memoryview(into).cast("B")[:1] = b"\xee"  # part of it arrived, then the medium failed
            raise answer
        if answer is not True:
            memoryview(into).cast("B")[:] = b"\xee" * memoryview(into).nbytes  # what a short read left
            return answer
        return super().read(i, start, into)


def layered(blobs, layout, *, sealing=None, keep_blobs=False, answers=None, probe=None, seen=None):
    """Read ``blobs`` layer-wise: (outs, reasons per block (None: done, "absent": never
    reached), passes [(ready, raw_end)], kept blobs, the reader); ``seen`` gets the outs and
    reasons before anything is raised."""
    outs = [bytearray(b"\xa5" * layout.raw_len) for _ in blobs]
    reasons, kept, passes = ["absent"] * len(blobs), {}, []
    if seen is not None:
        seen.update(outs=outs, reasons=reasons)
    reader = Recorder(blobs, answers)
    opening = dict(namespace=NS, key=KEY, expect=layout)

    def fail(i, exc):
        reasons[i] = exc.reason if isinstance(exc, CorruptBlock) else repr(exc)

    def done(i, blob):
        reasons[i] = None
        kept[i] = None if blob is None else bytes(blob)

    LayeredBlocks(lambda i, prefix, n: BlockCodec.head_length(prefix, total_len=n, **opening),
                  lambda i, head, n: BlockCodec.segments(head, sealing=sealing, total_len=n, **opening),
                  [len(b) for b in blobs], reader, outs, fail, done,
                  lambda ready, end: passes.append((ready, end)),
                  HEADER_BYTES + table_len(8) if probe is None else probe, keep_blobs).run()
    return outs, reasons, passes, kept, reader


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
@pytest.mark.parametrize("segments", ["none", "two", "eight", "uneven"])
@pytest.mark.parametrize("dtype", ["bfloat16", "uint8"])
@pytest.mark.parametrize("codec", ["raw", "zstd", "zstd+shuffle"])
def test_blocks_opened_from_their_heads_arrive_whole_and_ready_frame_by_frame(codec, dtype, segments, sealed):
    layout = BlockLayout(dtype, SHAPE)
    raws = [kv_bytes(dtype, seed=s) for s in range(3)]
    lengths = plan(segments, len(raws[0]), ITEMSIZE[dtype])
    blobs = [BlockCodec(codec).encode(r, dtype=dtype, shape=SHAPE, namespace=NS, key=KEY, segments=lengths)
             for r in raws]
    if sealed:
        blobs = [bytes(BlockCodec.seal(b, SEALING, expect=layout)) for b in blobs]
    for keep in (False, True):
        outs, reasons, passes, kept, reader = layered(blobs, layout, sealing=SEALING if sealed else None,
                                                      keep_blobs=keep)
        assert reasons == [None] * 3 and [bytes(o) for o in outs] == raws
        ends = np.cumsum(lengths or [len(raws[0])]).tolist()
        assert passes == [([0, 1, 2], end) for end in ends]  # every block ready at every frame's end
        assert kept == {i: (b if keep else None) for i, b in enumerate(blobs)}  # the stored bytes, checked
        if codec == "raw" and not sealed and not keep:  # payload bytes read once, straight into out
            frames = [r for r in reader.reads if r[3] is not None and any(r[3] is o for o in outs)]
            assert sum(n for _, _, n, _ in frames) == 3 * len(raws[0])


def test_a_head_read_takes_more_reads_when_the_first_does_not_hold_it():
    layout = BlockLayout("bfloat16", SHAPE)
    raw = kv_bytes("bfloat16")
    blob = bytes(BlockCodec.seal(BlockCodec("zstd").encode(raw, dtype="bfloat16", shape=SHAPE, namespace=NS,
                                                             key=KEY, segments=plan("eight", len(raw), 2)),
                                 SEALING, expect=layout))
    outs, reasons, _, _, reader = layered([blob], layout, sealing=SEALING, probe=16)
    assert reasons == [None] and bytes(outs[0]) == raw
    heads = [(start, n) for _, start, n, _ in reader.reads[:-8]]  # then the 8 frames
    assert len(heads) == 5  # 16 bytes, the header, the frame count, the frame table, frame 0
    assert heads[0] == (0, 16) and all(b[0] == a[0] + a[1] for a, b in zip(heads, heads[1:]))


@pytest.mark.parametrize("name", sorted(SMALL))
def test_every_flipped_byte_is_caught_and_the_block_lost_from_its_frame_on(name):
    blob, raw, lengths = SMALL[name]
    header = BlockCodec.read_header(blob)
    layout = BlockLayout(header.dtype, header.shape)
    opened_at = HEADER_BYTES + table_len(len(lengths))
    block = BlockCodec.segments(blob)
    spans = [block.span(j) for j in range(len(lengths))]
    ends = np.cumsum(lengths).tolist()
    for pos in range(len(blob)):
        bad = bytearray(blob)
        bad[pos] ^= pos % 255 + 1
        outs, reasons, passes, _, _ = layered([bytes(bad)], layout, probe=opened_at)
        assert reasons == ["corrupt"], f"byte {pos}"
        hit = -1 if pos < opened_at else next(j for j, (lo, hi) in enumerate(spans) if lo <= pos < hi)
        assert [end for ready, end in passes if ready] == ends[:max(hit, 0)], f"byte {pos}: frames before it only"
        good = ends[hit - 1] if hit > 0 else 0
        assert outs[0][:good] == raw[:good]
        assert set(outs[0][good : ends[hit]] if hit >= 0 else b"") <= {0}, f"byte {pos}: its frame not cleared"


def test_a_refused_read_is_unreadable_a_value_gone_is_a_miss_and_neither_leaves_bytes_behind():
    layout = BlockLayout("bfloat16", SHAPE)
    raws = [kv_bytes("bfloat16", seed=s) for s in range(3)]
    lengths = plan("eight", len(raws[0]), 2)
    blobs = [BlockCodec("raw").encode(r, dtype="bfloat16", shape=SHAPE, namespace=NS, key=KEY, segments=lengths)
             for r in raws]
    third = BlockCodec.segments(blobs[0]).span(2)[0]  # (every block frames alike)
    outs, reasons, passes, _, _ = layered(blobs, layout, answers={(0, third): False, (2, third): None})
    assert reasons == ["unreadable", None, "absent"]
    assert bytes(outs[1]) == raws[1]
    for i in (0, 2):  # the frames before arrived; the refused one holds nothing of what was read
        assert outs[i][: 2 * lengths[0]] == raws[i][: 2 * lengths[0]]
        assert set(outs[i][2 * lengths[0] : 3 * lengths[0]]) == {0}
    assert [ready for ready, _ in passes] == [[0, 1, 2]] * 2 + [[1]] * 6


def test_the_mediums_own_failure_is_raised_blames_no_block_and_leaves_no_byte_of_it():
    """A medium failing partway through a read (part of the frame arrived) raises; no block is
    failed for it, the frame's place is cleared, and a block already whole and checked (framed
    in fewer groups) stays a hit."""
    layout = BlockLayout("bfloat16", SHAPE)
    raw = kv_bytes("bfloat16")
    two = BlockCodec("raw").encode(raw, dtype="bfloat16", shape=SHAPE, namespace=NS, key=KEY,
                                   segments=plan("two", len(raw), 2))
    one = BlockCodec("raw").encode(raw, dtype="bfloat16", shape=SHAPE, namespace=NS, key=KEY)
    later = BlockCodec.segments(two).span(1)[0]
    seen = {}
    with pytest.raises(BackendUnavailable):
        layered([one, two], layout, answers={(1, later): BackendUnavailable("no descriptors left")}, seen=seen)
    assert seen["reasons"] == [None, "absent"]  # (the read's bookkeeping makes "absent" the tier's miss)
    assert bytes(seen["outs"][0]) == raw
    half = len(raw) // 2
    assert seen["outs"][1][:half] == raw[:half] and set(seen["outs"][1][half:]) == {0}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_a_sealed_block_read_layer_wise_is_judged_as_a_whole_decode_judges_it(name):
    """Every flipped byte of a sealed block gets the reason a whole-block decode gives: with the
    key, and without it (a damaged frame anywhere is ``corrupt`` and dropped, not ``no_key``
    and kept, though a replica without the key opens only the head before knowing)."""
    blob, raw, _ = SMALL[name]
    header = BlockCodec.read_header(blob)
    layout = BlockLayout(header.dtype, header.shape)
    blob = bytes(BlockCodec.seal(blob, SEALING, expect=layout))
    for pos in range(0, len(blob), 7):
        bad = bytearray(blob)
        bad[pos] ^= pos % 255 + 1
        for sealing in (SEALING, None):
            try:
                BlockCodec().decode(bytes(bad), namespace=NS, key=KEY, expect=layout, sealing=sealing)
                whole = None
            except CorruptBlock as exc:
                whole = exc.reason
            _, reasons, _, _, _ = layered([bytes(bad)], layout, sealing=sealing)
            assert reasons == [whole], f"byte {pos}, key {sealing is not None}"
    _, reasons, _, _, _ = layered([blob], layout, sealing=None)
    assert reasons == ["no_key"]


def test_regression_a_block_framed_coarser_than_its_neighbours_was_named_ready_before_it_was_read():
    """An older block stored in one frame (or two) read beside blocks of eight frames was named
    ready at every pass of theirs, its bytes not read yet: a layer-wise load copied the
    engine stale slot bytes for its first layers and reported it loaded. A block is named only
    at its own frames' ends."""
    layout = BlockLayout("bfloat16", SHAPE)
    raws = [kv_bytes("bfloat16", seed=s) for s in range(3)]
    framings = [plan(name, len(raws[0]), 2) for name in ("eight", "none", "two")]
    blobs = [BlockCodec("raw").encode(r, dtype="bfloat16", shape=SHAPE, namespace=NS, key=KEY, segments=lengths)
             for r, lengths in zip(raws, framings)]
    outs, reasons, passes, _, _ = layered(blobs, layout)
    assert reasons == [None] * 3 and [bytes(o) for o in outs] == raws
    ends = [np.cumsum(lengths or [len(raws[0])]).tolist() for lengths in framings]
    for i, own in enumerate(ends):
        assert [end for ready, end in passes if i in ready] == own, f"block {i}"
