"""A byte backend seen as a tier of stored blocks: encode on write, validate on read.

Every failure becomes a counted miss with a reason (``absent``, ``corrupt``,
``namespace_mismatch``, ``<tier>_unavailable``, ``no_room``); nothing here raises into the
engine's path, and nothing that failed validation is handed out. A stored block is decoded
against the namespace's block layout: one whose header describes another shape, dtype or size,
or whose decoding fails in any way at all, is a ``corrupt`` miss and is removed from the tier.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from storage_backends.base import Backend
from tiered_kv.config import TierConfig
from tiered_kv.errors import BackendUnavailable, CorruptBlock
from tiered_kv.keys import Namespace
from tiered_kv.store import codec_choice
from tiered_kv.store.codec import HEADER_BYTES, BlockCodec, BlockLayout
from tiered_kv.store.metrics import StoreMetrics

log = logging.getLogger(__name__)


class EncodedTier:
    """One lower tier: ``backend`` holds stored blocks under ``namespace digest ‖ key``, written
    and read as ``config`` says (codec, policy, admission)."""

    def __init__(self, config: TierConfig, backend: Backend, namespace: Namespace,
                 metrics: StoreMetrics, codec: str | None = None) -> None:
        self.config = config
        self.name = config.name
        self.policy = config.policy
        self.backend = backend
        # the codec this tier writes ("auto" resolved by the store for its workers; alone, for one)
        self.codec = BlockCodec(codec or codec_choice.choose(config.codec, 1), config.level)
        self.namespace = namespace
        self.ns = namespace.digest()
        self.shape = namespace.block_shape
        self.layout = BlockLayout(namespace.dtype, self.shape)  # what every block here must be
        self.stored_max = HEADER_BYTES + self.layout.raw_len  # the largest stored block (raw)
        self.metrics = metrics
        self.unavailable = f"{config.name}_unavailable"

    # -- presence ----------------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Presence of each key; all False (counted) when the medium is down."""
        if not keys:
            return []
        try:
            return self.backend.contains_many([self.ns + k for k in keys])
        except BackendUnavailable:
            self.metrics.miss(self.name, self.unavailable, len(keys))
            return [False] * len(keys)

    # -- write -------------------------------------------------------------------------------
    def encode(self, key: bytes, payload, into=None):
        """The stored block of ``payload``: new bytes, or written into ``into`` (at least
        ``stored_max`` bytes) and returned as a view of it."""
        return self.codec.encode(payload, dtype=self.namespace.dtype, shape=self.shape,
                                 namespace=self.ns, key=key, into=into)

    def put_blobs(self, items: Sequence[tuple[bytes, bytes]], raw_bytes: int,
                  start: float | None = None, tenant: bytes = b"") -> list[bool]:
        """Store encoded blocks (``raw_bytes`` of payload in all) of ``tenant``; ``start`` = when
        encoding began."""
        return self._put([(self.ns + k, b) for k, b in items], raw_bytes,
                         time.perf_counter() if start is None else start, tenant)

    def _put(self, blobs: list[tuple[bytes, bytes]], raw: int, start: float, tenant: bytes) -> list[bool]:
        try:
            stored = self.backend.put_many(blobs, tenant=tenant)
        except BackendUnavailable:
            self.metrics.event(f"{self.name}_save_failed", len(blobs))
            self.metrics.miss(self.name, self.unavailable, 0)
            return [False] * len(blobs)
        ok = sum(stored)
        if ok < len(blobs):
            self.metrics.event(f"{self.name}_save_rejected", len(blobs) - ok)
        self.metrics.wrote(self.name, ok, raw * ok // max(1, len(blobs)),
                           sum(len(b) for (_, b), s in zip(blobs, stored) if s),
                           time.perf_counter() - start)
        return stored

    # -- read --------------------------------------------------------------------------------
    def read_into(self, keys: Sequence[bytes], outs: Sequence[object],
                  keep_blobs: bool = False) -> tuple[list[str | None], list[bytes | None]]:
        """Decode each present block into ``outs[i]`` (buffers of the namespace's block size);
        per key None (ok) or a miss reason. With ``keep_blobs`` the validated stored bytes come
        back too (to copy them down). A block that fails to decode, for whatever reason, is a
        ``corrupt`` (or ``namespace_mismatch``) miss and is removed from this tier; never raised."""
        want = self.layout.raw_len
        for out in outs:  # the caller's own buffers: a wrong one is its bug, not the block's
            if memoryview(out).nbytes != want:
                raise ValueError(f"{self.name} tier: output buffer of {memoryview(out).nbytes} bytes "
                                 f"for blocks of {want}")
        reasons: list[str | None] = ["absent"] * len(keys)
        blobs: list[bytes | None] = [None] * len(keys)
        corrupt: list[bytes] = []
        start = time.perf_counter()

        def decode(i: int, blob: memoryview) -> None:
            try:
                self.codec.decode(blob, namespace=self.ns, key=keys[i], out=outs[i], expect=self.layout)
            except Exception as exc:  # whatever a stored block makes decoding do is its fault
                reason, detail = ((exc.reason, exc.detail) if isinstance(exc, CorruptBlock)
                                  else ("corrupt", f"{type(exc).__name__}: {exc}"))
                reasons[i] = reason
                corrupt.append(keys[i])
                log.warning("%s tier: block %s is unusable (%s): %s", self.name, keys[i].hex(), reason,
                            " ".join(str(detail).split())[:200])
                return
            reasons[i] = None
            if keep_blobs:
                blobs[i] = bytes(blob)

        try:
            self.backend.visit_many([self.ns + k for k in keys], decode)
        except BackendUnavailable:
            reasons = [self.unavailable if r == "absent" else r for r in reasons]
        except Exception as exc:  # the medium failed in a way it does not name: unavailable too
            log.warning("%s tier: read failed (%s: %s)", self.name, type(exc).__name__,
                        " ".join(str(exc).split())[:200])
            reasons = [self.unavailable if r == "absent" else r for r in reasons]
        seconds = time.perf_counter() - start
        hits = [i for i, r in enumerate(reasons) if r is None]
        if hits:
            nbytes = sum(memoryview(outs[i]).nbytes for i in hits)
            self.metrics.hit(self.name, len(hits), nbytes, seconds)
        for r in reasons:
            if r is not None:
                self.metrics.miss(self.name, r)
        if corrupt:
            self._discard(corrupt)
        return reasons, blobs

    def _discard(self, keys: list[bytes]) -> None:
        """Remove blocks that failed validation so they stop costing misses."""
        try:
            self.backend.delete_many([self.ns + k for k in keys])
        except Exception as exc:  # a later read finds them again and retries
            log.warning("%s tier: could not remove %d unusable blocks (%s)", self.name, len(keys),
                        type(exc).__name__)

    def pin(self, keys: Sequence[bytes]) -> None:
        self.backend.pin_many([self.ns + k for k in keys])

    def unpin(self, keys: Sequence[bytes]) -> None:
        self.backend.unpin_many([self.ns + k for k in keys])
