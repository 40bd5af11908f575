"""Sealed blocks: a stored block whose body is encrypted and authenticated (AES-GCM) frame by
frame under its tenant's key, while its header and framing stay checkable without the key.

A sealed block is made from the plain block (:mod:`tiered_kv.store.codec`: compressed first,
then encrypted; compressing ciphertext would gain nothing). Its header is the plain block's with
the SEALED flag, ``stored_len`` the sealed body's length, and ``checksum`` / ``body_check`` the
xxh3-64 / xxh32 of the frame table. The body, little-endian::

    u32 count
    count x (u32 sealed_len, u32 check)      # check: xxh3-64 & 0xFFFFFFFF of the sealed frame
    count x (nonce[12] | ciphertext | tag[16])

Frame 0 seals ``u64 checksum | u32 body_check`` of the plain block (its payload hash and body
check: they stay secret) followed by its whole body (an unsegmented block: count is 1) or by its
segment table (a segmented one); frame j+1 seals segment j's stored body. So a layer-wise load
authenticates and decrypts each layer group on its own before any byte of it is used, and a
reader without the key can still check every header field, the frame table and every frame's
check over the ciphertext (``tiered-kv verify``).

Each frame has its own random 96-bit nonce (the NIST bound for random nonces, 2^32 frames per
key, is about 477 million blocks of 8 layer groups, 9 frames each, per tenant and secret: a
fleet writing more under one should rotate its secret). Its associated data binds it to where it was
stored: a domain tag, the namespace digest, the block key, codec, dtype, shape, raw length, the
frame's index and count, and the tenant label; a blob copied under another key, namespace or
tenant (or a frame moved within a block) fails authentication. Failures: a check or the framing
-> ``corrupt``; no key here -> ``no_key``; authentication -> ``wrong_key`` (another secret or
tenant, or a tampered block whose checks were recomputed). The cipher itself is the caller's
(:class:`Sealing`: an object with AESGCM's ``encrypt``/``decrypt``); no crypto library and no
torch here.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import xxhash

from tiered_kv.errors import CorruptBlock
from tiered_kv.store.codec_body import CODECS, body_check
from tiered_kv.store.codec_header import DTYPE_CODES, HEADER_BYTES, MAX_NDIM, SEALED, pack_header
from tiered_kv.store.codec_segments import (
    MAX_SEGMENTS,
    BlockSegments,
    check_body,
    open_segments,
    read_table,
    table_len,
)

NONCE = 12
TAG = 16
OVERHEAD = NONCE + TAG  # bytes a frame grows by when sealed
ENV_HEAD = struct.Struct("<I")
ENV_ENTRY = struct.Struct("<II")  # sealed_len, check
INNER = struct.Struct("<QI")  # the plain block's checksum and body check, first in frame 0
AAD = struct.Struct(f"<8s16s16sBB{MAX_NDIM}IQII")  # domain, namespace, key, codec, dtype, dims, raw_len, j, n
DOMAIN = b"TKVSEAL1"
MIN_SEALED = ENV_HEAD.size + ENV_ENTRY.size + OVERHEAD + INNER.size  # the smallest sealed body


@dataclass(frozen=True)
class Sealing:
    """One tenant's cipher: ``aead`` has AESGCM's ``encrypt(nonce, data, aad)`` (ciphertext and
    tag) and ``decrypt`` (raising on a failed tag); ``tenant`` is the label bound into every frame."""

    aead: Any
    tenant: bytes = b""


def env_len(n: int) -> int:
    """Bytes of the frame table of ``n`` frames."""
    return ENV_HEAD.size + n * ENV_ENTRY.size


def most_stored(raw_len: int, size: int, sealed: bool) -> int:
    """The most body bytes a block of ``raw_len`` payload bytes (items of ``size``) is ever
    stored in: its payload (a body never outgrows it), the table of as many segments as it can
    have and, sealed, every frame's overhead and the frame table. A longer body is a lie (a
    zstd skippable frame after the payload's decodes fine), refused before it is read on."""
    n = min(MAX_SEGMENTS, raw_len // size)
    most = raw_len + (table_len(n) if n > 1 else 0)
    return most + env_len(n + 1) + (n + 1) * OVERHEAD + INNER.size if sealed else most


def frame_aad(header: Any, tenant: bytes, j: int, n: int) -> bytes:
    """The associated data of frame ``j`` of ``n`` of a block: where it belongs."""
    dims = tuple(header.shape) + (0,) * (MAX_NDIM - len(header.shape))
    return AAD.pack(DOMAIN, header.namespace, header.key, CODECS[header.codec], DTYPE_CODES[header.dtype],
                    *dims, header.raw_len, j, n) + tenant


def seal_block(header: Any, body: memoryview, size: int, sealing: Sealing) -> bytearray:
    """The sealed block of a validated plain block (``header``, ``body``)."""
    inner = INNER.pack(header.checksum, header.body_check)
    if header.segmented:
        ranges = open_segments(header, body, size, True).stored_ranges()
        plain = [inner + bytes(body[: ranges[0][0]])] + [body[lo:hi] for lo, hi in ranges]  # table, segments
    else:
        plain = [inner + bytes(body)]
    n = len(plain)
    # one buffer for the whole sealed block; each frame encrypted straight into its place
    # (encrypt, then joining nonce, ciphertext and frames, copied every byte twice more: the
    # seal ran at 1.9 GB/s on a 2 MiB block)
    first = HEADER_BYTES + env_len(n)
    out = bytearray(first + sum(len(d) + OVERHEAD for d in plain))
    view = memoryview(out)
    into = getattr(sealing.aead, "encrypt_into", None)
    frames, pos = [], first
    for j, data in enumerate(plain):
        end = pos + len(data) + OVERHEAD
        nonce = os.urandom(NONCE)
        view[pos : pos + NONCE] = nonce
        aad = frame_aad(header, sealing.tenant, j, n)
        if into is not None:
            into(nonce, data, aad, view[pos + NONCE : end])
        else:
            view[pos + NONCE : end] = sealing.aead.encrypt(nonce, data, aad)
        frames.append(view[pos:end])
        pos = end
    table = ENV_HEAD.pack(n) + b"".join(ENV_ENTRY.pack(len(f), body_check(f)) for f in frames)
    view[HEADER_BYTES:first] = table
    view[:HEADER_BYTES] = pack_header(
        header.codec, header.dtype, header.level, header.shape, header.namespace, header.key, header.raw_len,
        len(out) - HEADER_BYTES, xxhash.xxh3_64_intdigest(table), xxhash.xxh32_intdigest(table),
        header.created, header.flags | SEALED)
    return out


def open_sealed(header: Any, body: memoryview, size: int, sealing: Sealing | None,
                body_len: int | None = None) -> BlockSegments:
    """``body`` of a sealed block (``header`` validated) opened for decoding segment-wise: the
    frame table validated, frame 0 checked, authenticated and its plain table validated against
    the header; later frames are opened as their segments are decoded. Without ``sealing``
    every frame's check is verified (those in ``body``, where it is the first ``head_len``
    bytes of a body of ``body_len``) and then a ``no_key`` CorruptBlock raised."""
    frames = _frames(header, body, len(body) if body_len is None else body_len)
    if sealing is None:
        for j, (lo, hi, check) in enumerate(frames):
            if hi <= len(body):
                _checked(body[lo:hi], check, j)
        raise CorruptBlock("the block is encrypted and no encryption secret is set here", reason="no_key")
    lo, hi, check = frames[0]
    first = _open_frame(header, body[lo:hi], check, 0, len(frames), sealing)
    if len(first) < INNER.size:
        raise CorruptBlock("sealed frame 0 is shorter than its fixed fields")
    checksum, check = INNER.unpack_from(first)
    inner_len = sum(hi - lo - OVERHEAD for lo, hi, _ in frames) - INNER.size
    plain = header._replace(flags=header.flags & ~SEALED, stored_len=inner_len, checksum=checksum,
                            body_check=check)
    check_body(plain, size)
    if not plain.segmented:
        if len(frames) != 1:
            raise CorruptBlock(f"unsegmented sealed block of {len(frames)} frames")
        block = open_segments(plain, memoryview(first)[INNER.size :], size, False)
        block.header = header
        return block
    buf = memoryview(bytearray(inner_len))
    table = memoryview(first)[INNER.size :]
    buf[: len(table)] = table
    segs = read_table(plain, buf, size)
    if len(frames) != len(segs) + 1 or segs[0][3] != len(table) or any(
            hi - lo - OVERHEAD != seg[4] - seg[3] for (lo, hi, _), seg in zip(frames[1:], segs)):
        raise CorruptBlock(f"{len(frames)} sealed frames do not match a table of {len(segs)} segments")
    return SealedSegments(header, buf, size, segs, body, frames, sealing)


class SealedSegments(BlockSegments):
    """A sealed segmented block: segment j's frame is checked, authenticated and decrypted into
    the plain body when segment j is first checked, then decoded as a plain segment."""

    __slots__ = ("_sealed", "_frames", "_sealing", "_opened")

    def __init__(self, header: Any, plain: memoryview, size: int, segs: list[tuple], sealed: memoryview,
                 frames: list[tuple[int, int, int]], sealing: Sealing) -> None:
        super().__init__(header, plain, size, segs)
        self._sealed, self._frames, self._sealing = sealed, frames, sealing
        self._opened: set[int] = set()

    def span(self, j: int) -> tuple[int, int]:
        lo, hi, _ = self._frames[j + 1]
        return HEADER_BYTES + lo, HEADER_BYTES + hi

    def held(self, j: int) -> bool:
        return self._frames[j + 1][1] <= len(self._sealed)

    def in_place(self, j: int) -> bool:
        return False  # stored as ciphertext

    def _check(self, j: int, stored=None):
        """Segment ``j``'s frame (``stored``: its sealed bytes, else the block's own) opened
        into the plain body, then checked as a plain segment."""
        if j not in self._opened:
            _, _, _, lo, hi, _, _ = self._segs[j]
            flo, fhi, check = self._frames[j + 1]
            if stored is None:
                stored = self._sealed[flo:fhi]
            else:  # the caller read frame j+1 alone
                stored = memoryview(stored).cast("B")
                if len(stored) != fhi - flo:
                    raise ValueError(f"sealed frame {j + 1} is {fhi - flo} bytes, {len(stored)} given")
            _open_frame(self.header, stored, check, j + 1, len(self._frames), self._sealing,
                        into=self._body[lo:hi])
            self._opened.add(j)
        return super()._check(j)


def head_len(body: memoryview) -> int:
    """Bytes of a sealed body's head (frame table and frame 0, which holds the plain table)
    given its first bytes: what they show so far (CorruptBlock: a count out of bounds)."""
    if len(body) < ENV_HEAD.size:
        return ENV_HEAD.size
    (n,) = ENV_HEAD.unpack_from(body)
    if not 1 <= n <= MAX_SEGMENTS + 1:
        raise CorruptBlock(f"sealed frame table declares {n} frames")
    if len(body) < env_len(n):
        return env_len(n)
    length, _ = ENV_ENTRY.unpack_from(body, ENV_HEAD.size)
    return env_len(n) + length


def _frames(header: Any, body: memoryview, body_len: int) -> list[tuple[int, int, int]]:
    """The frame table, validated against the header and the body (``body_len`` bytes, of
    which ``body`` holds at least the table): (start, end, check) each."""
    if len(body) < ENV_HEAD.size:
        raise CorruptBlock("truncated sealed frame table")
    (n,) = ENV_HEAD.unpack_from(body)
    if not 1 <= n <= MAX_SEGMENTS + 1 or env_len(n) > len(body):
        raise CorruptBlock(f"sealed frame table declares {n} frames in a {len(body)}-byte body")
    table = body[: env_len(n)]
    if (xxhash.xxh3_64_intdigest(table) != header.checksum
            or xxhash.xxh32_intdigest(table) != header.body_check):
        raise CorruptBlock("sealed frame table checksum mismatch")
    frames, at = [], len(table)
    for j, (length, check) in enumerate(ENV_ENTRY.iter_unpack(table[ENV_HEAD.size :])):
        if length < OVERHEAD + (INNER.size if j == 0 else 1):
            raise CorruptBlock(f"sealed frame {j} of {length} bytes")
        frames.append((at, at + length, check))
        at += length
    if at != body_len:
        raise CorruptBlock(f"sealed frames cover {at} bytes, the body has {body_len}")
    return frames


def _checked(sealed: memoryview, check: int, j: int) -> memoryview:
    """Sealed frame ``j``'s bytes, its ``check`` verified over the ciphertext."""
    if body_check(sealed) != check:
        raise CorruptBlock(f"sealed frame {j} checksum mismatch")
    return sealed


def _open_frame(header: Any, sealed: memoryview, check: int, j: int, n: int,
                sealing: Sealing, into: memoryview | None = None) -> bytes | None:
    """Frame ``j`` of ``n`` (its bytes ``sealed``) checked (over its ciphertext), authenticated
    and decrypted: returned, or written into ``into`` (its plaintext length; a frame that fails
    authentication may leave bytes there, which the caller never uses: it raises)."""
    sealed = _checked(sealed, check, j)
    aad = frame_aad(header, sealing.tenant, j, n)
    try:
        if into is None:
            return sealing.aead.decrypt(sealed[:NONCE], sealed[NONCE:], aad)
        decrypt_into = getattr(sealing.aead, "decrypt_into", None)
        if decrypt_into is None:
            into[:] = sealing.aead.decrypt(sealed[:NONCE], sealed[NONCE:], aad)
        else:
            decrypt_into(sealed[:NONCE], sealed[NONCE:], aad, into)
        return None
    except Exception:  # InvalidTag: another key or tenant, or a block moved or tampered with
        raise CorruptBlock(f"sealed frame {j} does not authenticate under this tenant's key "
                           "(another secret or tenant, or a block moved)", reason="wrong_key") from None
