"""Sealed (encrypted) blocks at the codec: the right tenant key gives back the payload, frame by
frame too; no key, another key, another tenant, a blob moved under another key or namespace, or
frames moved within a block never give plaintext (typed CorruptBlock reasons); the stored bytes
hold no run of the payload; the framing stays checkable without the key."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from tiered_kv.errors import CorruptBlock
from tiered_kv.store.codec import HEADER_BYTES, BlockCodec, BlockLayout
from tiered_kv.store.codec_header import pack_header
from tiered_kv.store.codec_sealed import ENV_ENTRY, ENV_HEAD, NONCE, env_len
from tiered_kv.store.tenant_cipher import TenantCipher, derive_key

NS, OTHER_NS = b"n" * 16, b"m" * 16
KEY, OTHER_KEY = b"k" * 16, b"j" * 16
SHAPE = (8, 2, 16, 4, 32)  # 64 KiB of float16
LAYOUT = BlockLayout("float16", SHAPE)
SECRET = b"a secret of enough bytes"
ALICE, BOB = b"alice-8b", b"bob--8by"


def payload(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scale = rng.random(SHAPE[-2:]) * 4  # per channel: compresses like real KV
    return (rng.standard_normal(SHAPE) * scale).astype(np.float16)


def plain(codec: str = "zstd+shuffle", segments: int = 1, data: np.ndarray | None = None,
          key: bytes = KEY, ns: bytes = NS) -> bytes:
    data = payload() if data is None else data
    segs = None if segments == 1 else [data.nbytes // segments] * segments
    return BlockCodec(codec).encode(data, dtype="float16", shape=SHAPE, namespace=ns, key=key, segments=segs)


def sealed(blob: bytes, tenant: bytes = ALICE, secret: bytes = SECRET) -> bytes:
    return bytes(BlockCodec.seal(blob, TenantCipher(secret).sealing(tenant), expect=LAYOUT))


def decode(blob: bytes, tenant: bytes | None = ALICE, secret: bytes = SECRET, key: bytes = KEY, ns: bytes = NS):
    sealing = None if tenant is None else TenantCipher(secret).sealing(tenant)
    return BlockCodec().decode(blob, namespace=ns, key=key, expect=LAYOUT, sealing=sealing)


def reason_of(fn) -> str:
    with pytest.raises(CorruptBlock) as info:
        fn()
    return info.value.reason


def rekeyed(blob: bytes, *, key: bytes | None = None, ns: bytes | None = None, body: bytes | None = None,
            checks: tuple[int, int] | None = None) -> bytes:
    """``blob`` as someone who can write the medium would move it: the header rewritten (key,
    namespace, table hashes) with a valid header checksum, the body as given."""
    h = BlockCodec.read_header(blob)
    body = blob[HEADER_BYTES:] if body is None else body
    checksum, check = checks or (h.checksum, h.body_check)
    head = pack_header(h.codec, h.dtype, h.level, h.shape, ns or h.namespace, key or h.key, h.raw_len,
                       len(body), checksum, check, h.created, h.flags)
    return head + body


@pytest.mark.parametrize("codec", ["raw", "zstd", "zstd+shuffle"])
@pytest.mark.parametrize("segments", [1, 4])
def test_the_tenants_key_gives_back_the_payload_whole_and_frame_by_frame(codec, segments):
    data = payload()
    blob = sealed(plain(codec, segments, data))
    header, out = decode(blob)
    assert header.sealed and header.segmented == (segments > 1)
    assert bytes(out) == data.tobytes()
    block = BlockCodec.segments(blob, namespace=NS, key=KEY, expect=LAYOUT,
                                sealing=TenantCipher(SECRET).sealing(ALICE))
    assert len(block) == segments
    got = bytearray(data.nbytes)
    for j, (start, end) in enumerate(block.bounds):
        block.decode(j, memoryview(got)[start:end])
        assert got[:end] == data.tobytes()[:end]  # each frame usable as soon as it is opened
    assert BlockCodec.seal(blob, TenantCipher(SECRET).sealing(ALICE)) is blob  # sealed already: as is


@pytest.mark.parametrize("segments", [1, 4])
def test_stored_bytes_hold_no_run_of_the_payload_or_of_its_plain_block(segments):
    data = payload(1)
    clear = plain("raw", segments, data)  # raw: the plain block holds the payload verbatim
    blob = sealed(clear)
    windows = {blob[i : i + 16] for i in range(len(blob) - 15)}
    raw = data.tobytes()
    chunks = [raw[i : i + 16] for i in range(0, len(raw), 16)]  # any 31-byte run holds one of these
    assert any(c in clear for c in chunks[:8])  # the check finds plaintext where there is some
    assert not any(c in windows for c in chunks)
    body = clear[HEADER_BYTES:]
    assert not any(body[i : i + 16] in windows for i in range(0, len(body) - 15, 16))


def test_every_frame_gets_its_own_nonce_and_sealing_twice_differs():
    clear = plain("zstd+shuffle", 4)
    a, b = sealed(clear), sealed(clear)
    assert a != b and decode(a)[1].tobytes() == decode(b)[1].tobytes()
    nonces = []
    for blob in (a, b):
        body = blob[HEADER_BYTES:]
        (n,) = ENV_HEAD.unpack_from(body)
        at = env_len(n)
        for length, _ in ENV_ENTRY.iter_unpack(body[ENV_HEAD.size : env_len(n)]):
            nonces.append(body[at : at + NONCE])
            at += length
    assert len(nonces) == 10 and len(set(nonces)) == 10


@pytest.mark.parametrize("segments", [1, 4])
def test_without_the_key_a_replica_gets_a_no_key_reason_never_bytes(segments):
    blob = sealed(plain(segments=segments))
    assert reason_of(lambda: decode(blob, tenant=None)) == "no_key"
    out = bytearray(LAYOUT.raw_len)
    with pytest.raises(CorruptBlock):
        BlockCodec().decode(blob, namespace=NS, key=KEY, expect=LAYOUT, out=out)
    assert not any(out)


@pytest.mark.parametrize("segments", [1, 4])
def test_another_secret_or_tenant_fails_authentication(segments):
    blob = sealed(plain(segments=segments))
    assert reason_of(lambda: decode(blob, secret=b"another secret of bytes")) == "wrong_key"
    assert reason_of(lambda: decode(blob, tenant=BOB)) == "wrong_key"
    assert reason_of(lambda: decode(blob, tenant=b"")) == "wrong_key"


def test_a_plain_block_is_refused_where_blocks_are_encrypted():
    assert reason_of(lambda: decode(plain())) == "unencrypted"


@pytest.mark.parametrize("segments", [1, 4])
def test_a_blob_moved_under_another_key_or_namespace_fails_even_with_its_header_rewritten(segments):
    blob = sealed(plain(segments=segments))
    assert reason_of(lambda: decode(blob, key=OTHER_KEY)) == "corrupt"  # header names its own key
    moved = rekeyed(blob, key=OTHER_KEY)
    assert reason_of(lambda: decode(moved, key=OTHER_KEY)) == "wrong_key"
    moved_ns = rekeyed(blob, ns=OTHER_NS)
    assert reason_of(lambda: decode(moved_ns, ns=OTHER_NS)) == "wrong_key"


def test_frames_swapped_within_a_block_fail_authentication():
    blob = sealed(plain("raw", 4))  # raw segments: frames 1..4 of one size
    body = blob[HEADER_BYTES:]
    (n,) = ENV_HEAD.unpack_from(body)
    entries = list(ENV_ENTRY.iter_unpack(body[ENV_HEAD.size : env_len(n)]))
    starts = [env_len(n)]
    for length, _ in entries:
        starts.append(starts[-1] + length)
    frames = [body[s:e] for s, e in zip(starts, starts[1:])]
    assert len(frames[1]) == len(frames[2])
    frames[1], frames[2] = frames[2], frames[1]
    entries[1], entries[2] = entries[2], entries[1]
    table = ENV_HEAD.pack(n) + b"".join(ENV_ENTRY.pack(*e) for e in entries)
    swapped = rekeyed(blob, body=table + b"".join(frames),
                      checks=(xxhash.xxh3_64_intdigest(table), xxhash.xxh32_intdigest(table)))
    assert reason_of(lambda: decode(swapped)) == "wrong_key"


@pytest.mark.parametrize("where", [-1, HEADER_BYTES + 40, HEADER_BYTES + 2])
def test_a_flipped_byte_is_corrupt_before_any_key_is_tried(where):
    blob = bytearray(sealed(plain(segments=4)))
    blob[where] ^= 0x10
    assert reason_of(lambda: decode(bytes(blob))) == "corrupt"
    assert reason_of(lambda: decode(bytes(blob), tenant=None)) == "corrupt"  # found without the key too


def test_the_header_reads_without_the_key():
    clear = plain(segments=4)
    blob = sealed(clear)
    h, p = BlockCodec.read_header(blob, namespace=NS, key=KEY, expect=LAYOUT), BlockCodec.read_header(clear)
    assert h.sealed and not p.sealed
    assert (h.codec, h.dtype, h.shape, h.raw_len, h.key) == (p.codec, p.dtype, p.shape, p.raw_len, p.key)
    assert h.checksum != p.checksum  # the plain block's payload hash travels encrypted


def test_keys_are_derived_per_tenant_and_secret():
    keys = {derive_key(s, t) for s in (SECRET, b"another secret of bytes") for t in (b"", ALICE, BOB)}
    assert len(keys) == 6 and all(len(k) == 32 for k in keys)
    assert derive_key(SECRET, ALICE) == derive_key(SECRET, ALICE)
    assert SECRET.decode() not in repr(TenantCipher(SECRET))
