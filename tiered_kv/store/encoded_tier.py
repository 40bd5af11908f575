"""A byte backend seen as a tier of stored blocks: encode on write, validate on read.

Every failure becomes a counted miss with a reason (``absent``, ``corrupt``,
``namespace_mismatch``, ``<tier>_unavailable``, ``no_room``); nothing here raises into the
engine's path, and nothing that failed validation is handed out. A stored block is decoded
against the namespace's block layout: one whose header describes another shape, dtype or size,
or whose decoding fails in any way at all, is a ``corrupt`` miss and is removed from the tier.

With an encryption secret every block is sealed under its tenant's key as it is stored
(:meth:`BlockCodec.seal`; blocks copied up from a lower tier are sealed already) and only sealed
blocks are read. A block this replica cannot open (``no_key``: no secret here; ``wrong_key``:
another secret or tenant) is a counted miss but stays in the tier: it may be good for a replica
that holds its key. A plain block where blocks are encrypted (``unencrypted``: written before
encryption was on) is a miss removed like a corrupt one, so a sealed copy can take its place.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from storage_backends.base import Backend
from tiered_kv.config import Secret, TierConfig
from tiered_kv.errors import BackendUnavailable, CorruptBlock
from tiered_kv.keys import Namespace
from tiered_kv.store import codec_choice
from tiered_kv.store.codec import BlockCodec, BlockLayout, Sealing, max_stored_len
from tiered_kv.store.codec_body import clear
from tiered_kv.store.codec_header import HEADER_BYTES
from tiered_kv.store.codec_segments import table_len
from tiered_kv.store.codec_split import check_split
from tiered_kv.store.layer_frames import layer_segments, smallest_frame
from tiered_kv.store.layered_reads import LayeredBlocks
from tiered_kv.store.metrics import StoreMetrics
from tiered_kv.store.tenant_cipher import TenantCipher

log = logging.getLogger(__name__)

# miss reasons of blocks another replica may read: counted, never removed
KEY_REASONS = frozenset({"no_key", "wrong_key"})
FOREIGN_KEPT = 1 << 16  # the most keys a tier remembers as sealed under another secret


class EncodedTier:
    """One lower tier: ``backend`` holds stored blocks under ``namespace digest ‖ key``, written
    and read as ``config`` says (codec, policy, admission); sealed under ``secret`` when given."""

    def __init__(self, config: TierConfig, backend: Backend, namespace: Namespace,
                 metrics: StoreMetrics, codec: str | None = None, layer_groups: int = 1,
                 secret: Secret | None = None) -> None:
        self.config = config
        self.name = config.name
        self.policy = config.policy
        self.backend = backend
        self.namespace = namespace
        self.ns = namespace.digest()
        self.shape = namespace.block_shape
        self.layout = BlockLayout(namespace.dtype, self.shape)  # what every block here must be
        # raw byte length of each layer group a block is framed in (None: one frame)
        self.segments = layer_segments(namespace, self.layout.raw_len, layer_groups)
        # the codec this tier writes ("auto" resolved by the store for its workers; alone, for one)
        self.codec = BlockCodec(codec or codec_choice.choose(
            config.codec, 1, frame_bytes=smallest_frame(namespace, self.layout.raw_len, layer_groups)), config.level)
        # the largest stored block (every frame raw)
        self.stored_max = max_stored_len(self.layout.raw_len, len(self.segments or (0,)))
        # a plain block's header and segment table (exactly, for one this tier framed): what a
        # layer-wise read reads of each block first (a sealed block's head takes a read or two more)
        self.head_bytes = HEADER_BYTES + (table_len(len(self.segments)) if self.segments else 0)
        self.metrics = metrics
        self.unavailable = f"{config.name}_unavailable"
        self.cipher = None if secret is None else TenantCipher(secret.reveal())  # None: blocks stay plain
        self.said: set[str] = set()  # KEY_REASONS already logged as a warning
        # keys read here as ``wrong_key`` (sealed under another secret: a rotated one): the next
        # save of each replaces it, or the block would miss here for good (oldest forgotten first)
        self.foreign: dict[bytes, None] = {}
        self._foreign_lock = threading.Lock()
        # raw blocks go to the medium as head + payload where it lies, written with one gathered
        # write (no copy next to the head), when the medium takes that and nothing is encrypted
        self.gathers = (getattr(backend, "takes_gathered", False) and self.codec.codec == "raw"
                        and self.cipher is None)  # (a duck-typed medium takes one buffer)

    def sealing(self, tenant: bytes) -> Sealing | None:
        """``tenant``'s cipher, or None when this tier's blocks are plain."""
        return None if self.cipher is None else self.cipher.sealing(tenant)

    # -- presence ----------------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Presence of each key, for a save (one held is not written again); all False when the
        medium is down (not a miss: no block was asked for; the put that follows counts the
        failed write). A key this replica read as sealed under another secret counts as absent,
        so the save replaces that block with one this replica can open."""
        if not keys:
            return []
        try:
            held = self.backend.contains_many([self.ns + k for k in keys])
        except BackendUnavailable:
            return [False] * len(keys)
        foreign = self.foreign
        return [h and k not in foreign for k, h in zip(keys, held)] if foreign else held

    def _mark_foreign(self, key: bytes) -> None:
        if self.cipher is None:  # (a replica without a secret would replace sealed blocks by plain ones)
            return
        with self._foreign_lock:
            self.foreign[key] = None
            while len(self.foreign) > FOREIGN_KEPT:
                del self.foreign[next(iter(self.foreign))]

    def _replaced(self, keys: list[bytes]) -> None:
        with self._foreign_lock:
            for k in keys:
                self.foreign.pop(k, None)

    # -- write -------------------------------------------------------------------------------
    def encode(self, key: bytes, payload, into=None):
        """The stored block of ``payload``: new bytes, or written into ``into`` (at least
        ``stored_max`` bytes) and returned as a view of it; for a tier that :attr:`gathers`,
        its head and ``payload`` itself (``into`` unused: keep ``payload`` until it is put)."""
        return self.codec.encode(payload, dtype=self.namespace.dtype, shape=self.shape, namespace=self.ns,
                                 key=key, into=None if self.gathers else into, segments=self.segments,
                                 gathered=self.gathers)

    def put_blobs(self, items: Sequence[tuple[bytes, bytes]], raw_bytes: int,
                  start: float | None = None, tenant: bytes = b"") -> list[bool]:
        """Store encoded blocks (``raw_bytes`` of payload in all) of ``tenant``, sealed under its key
        when this tier encrypts; ``start`` = when encoding began."""
        start = time.perf_counter() if start is None else start
        sealing = self.sealing(tenant)
        if sealing is not None:
            items = [(k, self.codec.seal(b, sealing, expect=self.layout)) for k, b in items]
        return self._put([(self.ns + k, b) for k, b in items], raw_bytes, start, tenant)

    def _put(self, blobs: list[tuple[bytes, bytes]], raw: int, start: float, tenant: bytes) -> list[bool]:
        try:
            stored = self.backend.put_many(blobs, tenant=tenant)
        except BackendUnavailable:
            self.metrics.event(f"{self.name}_save_failed", len(blobs))
            self.metrics.miss(self.name, self.unavailable, 0)
            return [False] * len(blobs)
        if self.foreign:
            self._replaced([k[len(self.ns):] for (k, _), s in zip(blobs, stored) if s])
        ok = sum(stored)
        if ok < len(blobs):
            self.metrics.event(f"{self.name}_save_rejected", len(blobs) - ok)
        self.metrics.wrote(self.name, ok, raw * ok // max(1, len(blobs)),
                           sum(len(b) for (_, b), s in zip(blobs, stored) if s),
                           time.perf_counter() - start)
        return stored

    # -- read --------------------------------------------------------------------------------
    def read_into(self, keys: Sequence[bytes], outs: Sequence[object],
                  keep_blobs: bool = False, tenant: bytes = b"") -> tuple[list[str | None], list[bytes | None]]:
        """Decode each present block of ``tenant`` into ``outs[i]`` (buffers of the namespace's
        block size); per key None (ok) or a miss reason. With ``keep_blobs`` the validated stored
        bytes come back too (to copy them down). A block that fails to decode, for whatever
        reason, is a ``corrupt`` (or ``namespace_mismatch``) miss and is removed from this tier
        (one this replica has no key for is a KEY_REASONS miss and stays); never raised."""
        read = _Read(self, keys, outs, keep_blobs)
        sealing = self.sealing(tenant)
        spilled: set[int] = set()  # blocks whose tail a split read left in outs[i], then read whole

        def decode(i: int, head: memoryview | None, blob: memoryview | None) -> bool:
            try:
                if head is not None:  # the medium read the block's payload straight into outs[i]
                    if not check_split(head, outs[i], namespace=self.ns, key=keys[i], expect=self.layout,
                                       sealing=sealing):
                        spilled.add(i)
                        return False  # not a plain raw block: have it whole
                else:
                    self.codec.decode(blob, namespace=self.ns, key=keys[i], out=outs[i], expect=self.layout,
                                      sealing=sealing)
            except Exception as exc:  # whatever a stored block makes decoding do is its fault
                if i in spilled:  # (e.g. a sealed block's ciphertext: no byte of it stays there)
                    clear(memoryview(outs[i]).cast("B"))
                read.fail(i, exc)
                return True
            read.done(i, blob if head is None else _Joined(head, outs[i]))
            return True

        full = [self.ns + k for k in keys]
        if sealing is not None:  # only sealed blocks are read, and none splits: each read whole, once
            return read.run(lambda: self.backend.visit_many(full, lambda i, blob: decode(i, None, blob)))
        reasons, blobs = read.run(lambda: self.backend.visit_split(full, outs, decode))
        for i in spilled:  # read split, then never whole (gone since, the medium failed): no tail left
            if reasons[i] is not None:
                clear(memoryview(outs[i]).cast("B"))
        return reasons, blobs

    def read_layered(self, keys: Sequence[bytes], outs: Sequence[object],
                     on_ready: Callable[[list[int], int], None],
                     keep_blobs: bool = False, tenant: bytes = b"") -> tuple[list[str | None], list[bytes | None]]:
        """:meth:`read_into` frame by frame: every block's first layer group, then every block's
        second, ... Each frame is checked before the engine may use a byte of it; after each
        pass ``on_ready(indices, raw_end)`` names the blocks whose first ``raw_end`` bytes are in
        their buffer, checked (a block failing later is still a miss, its reason as in
        :meth:`read_into`). Blocks framed in fewer groups (or one: older blocks) are ready at
        their own frames' ends. The medium reads each part when its pass starts
        (:mod:`tiered_kv.store.layered_reads`): one it cannot read (its file cut short, a disk
        error) makes its block an ``unreadable`` miss."""
        read = _Read(self, keys, outs, keep_blobs)
        sealing = self.sealing(tenant)
        opening = dict(namespace=self.ns, expect=self.layout)

        def head_length(i: int, prefix, total_len: int) -> int:
            return self.codec.head_length(prefix, total_len=total_len, key=keys[i], **opening)

        def open_block(i: int, head, total_len: int):
            return self.codec.segments(head, key=keys[i], sealing=sealing, total_len=total_len, **opening)

        def visit(sizes, reader) -> None:
            LayeredBlocks(head_length, open_block, sizes, reader, outs, read.fail, read.done, on_ready,
                          self.head_bytes, keep_blobs).run()

        return read.run(lambda: self.backend.visit_ranges([self.ns + k for k in keys], visit))

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


class _Read:
    """One read of a tier: per key a reason (``absent`` until seen), the validated stored bytes
    when they are kept, and the counting and clean-up every read ends with."""

    def __init__(self, tier: EncodedTier, keys: Sequence[bytes], outs: Sequence[object], keep_blobs: bool) -> None:
        want = tier.layout.raw_len
        for out in outs:  # the caller's own buffers: a wrong one is its bug, not the block's
            if memoryview(out).nbytes != want:
                raise ValueError(f"{tier.name} tier: output buffer of {memoryview(out).nbytes} bytes "
                                 f"for blocks of {want}")
        self.tier, self.keys, self.outs, self.keep_blobs = tier, keys, outs, keep_blobs
        self.reasons: list[str | None] = ["absent"] * len(keys)
        self.blobs: list[bytes | None] = [None] * len(keys)
        self.corrupt: list[bytes] = []
        self.locked = 0  # blocks missed for KEY_REASONS

    def fail(self, i: int, exc: BaseException) -> None:
        reason, detail = ((exc.reason, exc.detail) if isinstance(exc, CorruptBlock)
                          else ("corrupt", f"{type(exc).__name__}: {exc}"))
        self.reasons[i] = reason
        if reason in KEY_REASONS:  # good, maybe, for a replica holding the key: left in place
            self.locked += 1
            if reason == "wrong_key":  # ... until this replica saves the block again
                self.tier._mark_foreign(self.keys[i])
            log.debug("%s tier: block %s cannot be opened here (%s)", self.tier.name, self.keys[i].hex(), reason)
            return
        self.corrupt.append(self.keys[i])
        log.warning("%s tier: block %s is unusable (%s): %s", self.tier.name, self.keys[i].hex(), reason,
                    " ".join(str(detail).split())[:200])

    def done(self, i: int, blob) -> None:
        self.reasons[i] = None
        if self.keep_blobs:
            self.blobs[i] = blob.join() if isinstance(blob, _Joined) else bytes(blob)

    def run(self, visit: Callable[[], object]) -> tuple[list[str | None], list[bytes | None]]:
        tier, reasons = self.tier, self.reasons
        start = time.perf_counter()
        try:
            visit()
        except BackendUnavailable:
            reasons[:] = [tier.unavailable if r == "absent" else r for r in reasons]
        except Exception as exc:  # the medium failed in a way it does not name: unavailable too
            log.warning("%s tier: read failed (%s: %s)", tier.name, type(exc).__name__,
                        " ".join(str(exc).split())[:200])
            reasons[:] = [tier.unavailable if r == "absent" else r for r in reasons]
        seconds = time.perf_counter() - start
        hits = [i for i, r in enumerate(reasons) if r is None]
        if hits:
            tier.metrics.hit(tier.name, len(hits), len(hits) * tier.layout.raw_len, seconds)  # (outs checked)
        for r in reasons:
            if r is not None:
                tier.metrics.miss(tier.name, r)
        if self.corrupt:
            tier._discard(self.corrupt)
        if self.locked:  # said once per tier and reason (every read would repeat it), counted always
            new = {r for r in reasons if r in KEY_REASONS} - tier.said
            tier.said |= new
            log.log(logging.WARNING if new else logging.DEBUG, "%s tier: %d blocks are encrypted under a key "
                    "this replica does not have (%s: counted misses, blocks left in place)",
                    tier.name, self.locked, ", ".join(sorted({r for r in reasons if r in KEY_REASONS})))
        return reasons, self.blobs



class _Joined:
    """A block read in two pieces (its head, and the rest in the caller's buffer)."""

    def __init__(self, head, rest) -> None:
        self.head, self.rest = head, rest

    def join(self) -> bytes:
        return bytes(self.head) + bytes(memoryview(self.rest).cast("B"))
