"""Sealed blocks against someone who can write the medium, and against a weak secret.

Every byte of a small sealed block mutated (raw and compressed, one frame and framed per layer
group) gives a typed miss or the saved payload, never other bytes, read whole or head first and
frame by frame as a layer-wise load does. Forged blocks whose every check was recomputed (the
frame table cut short, frames spliced in from another save of the same key, the SEGMENTED flag
flipped, fields of the header rewritten) fail the same way. A secret handed to the config as a
``Secret`` object skipped the length check its text form gets, and a 1-byte secret sealed every
block under a key anyone could guess: the cipher refuses it too."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest
import xxhash

from tests.store.helpers import make_store
from tiered_kv.config import Secret, TieredKVConfig
from tiered_kv.errors import ConfigError, CorruptBlock
from tiered_kv.store.codec import HEADER, HEADER_BYTES, BlockCodec, BlockLayout
from tiered_kv.store.codec_body import body_check
from tiered_kv.store.codec_sealed import ENV_ENTRY, ENV_HEAD, env_len
from tiered_kv.store.tenant_cipher import TenantCipher

SHAPE = (4, 2, 2, 4, 8)  # 1 KiB of float16: small enough to mutate every byte
LAYOUT = BlockLayout("float16", SHAPE)
NS, KEY = b"n" * 16, b"k" * 16
SEALING = TenantCipher(b"a secret of enough bytes").sealing(b"alice-8b")
FRAMED = [256] * 4  # four layer groups
FLAGS, STORED, CHECKSUM, CHECK = 6, 16, 17, 18  # HEADER's field indices


def saved(codec: str, segments, seed: int = 0) -> tuple[bytes, bytes]:
    """(payload, its sealed block)."""
    data = np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float16)
    blob = BlockCodec(codec).encode(data, dtype="float16", shape=SHAPE, namespace=NS, key=KEY, segments=segments)
    return data.tobytes(), bytes(BlockCodec.seal(blob, SEALING, expect=LAYOUT))


def read_whole(blob: bytes) -> bytes:
    out = bytearray(LAYOUT.raw_len)
    BlockCodec().decode(blob, namespace=NS, key=KEY, expect=LAYOUT, sealing=SEALING, out=out)
    return bytes(out)


def read_frames(blob: bytes) -> bytes:
    """As a layer-wise load: the head first (as long as head_length asks), then each frame."""
    need, opening = HEADER_BYTES, dict(namespace=NS, key=KEY, expect=LAYOUT)
    for _ in range(6):
        more = BlockCodec.head_length(blob[:need], total_len=len(blob), **opening)
        if more <= need:
            break
        need = more
    block = BlockCodec.segments(blob[:need], sealing=SEALING, total_len=len(blob), **opening)
    out = bytearray(LAYOUT.raw_len)
    for j, (start, end) in enumerate(block.bounds):
        lo, hi = block.span(j)
        block.decode(j, memoryview(out)[start:end], None if block.held(j) else blob[lo:hi])
    return bytes(out)


def outcomes(blob: bytes, want: bytes) -> list[str]:
    """Per way of reading: "ok" (the saved payload) or the miss reason; anything else fails."""
    seen = []
    for read in (read_whole, read_frames):
        try:
            got = read(blob)
        except CorruptBlock as exc:  # (NamespaceMismatch is one)
            seen.append(exc.reason)
            continue
        assert got == want, "a mutated sealed block decoded to other bytes"
        seen.append("ok")
    return seen


def frames_of(blob: bytes) -> tuple[list, list[bytes]]:
    fields, body = list(HEADER.unpack_from(blob)), blob[HEADER_BYTES:]
    (n,) = ENV_HEAD.unpack_from(body)
    frames, at = [], env_len(n)
    for length, _ in ENV_ENTRY.iter_unpack(body[ENV_HEAD.size : env_len(n)]):
        frames.append(body[at : at + length])
        at += length
    return fields, frames


def forged(fields: list, frames: list[bytes]) -> bytes:
    """A sealed block of these header fields and frames, every check recomputed."""
    table = ENV_HEAD.pack(len(frames)) + b"".join(ENV_ENTRY.pack(len(f), body_check(f)) for f in frames)
    body = table + b"".join(frames)
    fields = list(fields)
    fields[STORED], fields[CHECKSUM], fields[CHECK] = (len(body), xxhash.xxh3_64_intdigest(table),
                                                       xxhash.xxh32_intdigest(table))
    head = HEADER.pack(*fields)
    return head[:-4] + struct.pack("<I", xxhash.xxh32_intdigest(head[:-4])) + body


@pytest.mark.parametrize("codec", ["raw", "zstd+shuffle"])
@pytest.mark.parametrize("segments", [None, FRAMED])
def test_every_byte_of_a_sealed_block_mutated_is_a_miss_or_the_payload(codec, segments):
    want, blob = saved(codec, segments)
    for i in range(len(blob)):
        for bit in (0x01, 0x80):
            mutated = bytearray(blob)
            mutated[i] ^= bit
            assert set(outcomes(bytes(mutated), want)) <= {"ok", "corrupt", "wrong_key", "namespace_mismatch"}


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_forged_sealed_blocks_with_every_check_recomputed_never_decode_to_other_bytes(codec):
    want, blob = saved(codec, FRAMED)
    fields, frames = frames_of(blob)
    assert outcomes(forged(fields, frames), want) == ["ok", "ok"]
    assert set(outcomes(forged(fields, frames[:-1]), want)) == {"wrong_key"}  # frame table cut short
    assert set(outcomes(forged(fields, [frames[0], frames[2], frames[1], *frames[3:]]), want)) == {"wrong_key"}
    _, other = frames_of(saved(codec, FRAMED, seed=1)[1])  # another save of the same key
    if [len(f) for f in other] == [len(f) for f in frames]:
        spliced = forged(fields, [*frames[:2], other[2], *frames[3:]])
        assert set(outcomes(spliced, want)) == {"corrupt"}
    flipped = list(fields)
    flipped[FLAGS] ^= 1  # SEGMENTED
    assert set(outcomes(forged(flipped, frames), want)) == {"corrupt"}
    rng = random.Random(7)
    for _ in range(300):  # frames cut, bytes flipped, reordered: the table made to match each time
        cut = [bytearray(f) for f in frames]
        j = rng.randrange(len(cut))
        if rng.random() < 0.5:
            cut[j][rng.randrange(len(cut[j]))] ^= 1 << rng.randrange(8)
        else:
            del cut[j][rng.randrange(1, len(cut[j])):]
        assert "ok" not in outcomes(forged(fields, [bytes(f) for f in cut]), want)


@pytest.mark.parametrize("secret", [b"", b"x", b"fifteen bytes!!"])
def test_regression_a_short_secret_sealed_blocks_under_a_guessable_key(secret):
    with pytest.raises(ConfigError, match="at least 16 bytes") as info:
        TenantCipher(secret)
    assert not secret or secret.decode() not in str(info.value)


def test_regression_a_short_secret_object_in_the_config_opened_an_encrypting_store(tmp_path):
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        make_store(tmp_path, encryption_secret=Secret(b"x")).close()


def test_regression_a_short_secret_object_passed_the_config_build():
    """The config read only a text secret's length; a Secret object was taken as it came."""
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        TieredKVConfig.from_dict({"encryption_secret": Secret(b"x" * 15)})
    assert TieredKVConfig.from_dict({"encryption_secret": Secret(b"x" * 16)}).encryption_secret == Secret(b"x" * 16)
