"""Reading blocks from the lower tiers into caller-given buffers: each tier in order is asked
for the blocks still missing, every block is validated while it is decoded, and a block read
from a lower tier is queued for the tiers above it that admit it (its validated stored bytes,
not re-encoded: a sealed block stays sealed, under its tenant's key; write-behind, so the load
ends without waiting for those writes). Used both for loads staged through host slots and for
direct loads into the caller's own host memory. The blocks are read as the tenant's (their key,
when blocks are encrypted)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tiered_kv.store.copies_up import CopiesUp, CopyWait
from tiered_kv.store.encoded_tier import EncodedTier
from tiered_kv.store.invalidation import Invalidations
from tiered_kv.store.metrics import StoreMetrics
from tiered_kv.store.saving import Saver


class LowerReader:
    """Handed the ordered lower tiers, the invalidations (withdrawn keys are never read), the
    saver (admission and tier records for copies up) and the metrics."""

    def __init__(self, tiers: list[EncodedTier], invalidations: Invalidations, saver: Saver,
                 metrics: StoreMetrics, block_nbytes: int) -> None:
        self.tiers = tiers
        self.invalidations = invalidations
        self.saver = saver
        self.copies = CopiesUp(saver)  # write-behind into the tiers above a lower tier's hit
        self.metrics = metrics
        self.block_nbytes = block_nbytes

    def read(self, keys: Sequence[bytes], outs: Sequence[object], counts: Sequence[int],
             tenant: bytes, on_ready: Callable[[list[int], int], None] | None = None,
             ) -> tuple[list[str | None], list[str | None]]:
        """Read ``keys`` into ``outs`` (writable buffers of one block each) from the first tier
        holding a good copy; per key (miss reason or None, tier that served it or None). Keys
        withdrawn meanwhile are not read (``invalidated``). The caller tracks the read as a
        write for invalidation (copies up are writes: a withdrawal deletes after them). A miss
        may leave its buffer partly written: the caller must not use it. With ``on_ready`` the
        tiers are read layer group by layer group (:meth:`EncodedTier.read_layered`) and
        ``on_ready(indices, raw_end)`` names the keys whose first ``raw_end`` bytes are checked
        and in place. A block some of whose bytes were named so is never read again from a
        later tier (the caller may have used them: a later tier's failed read could clear them,
        a good one could differ); it stays a miss with its first reason."""
        reasons: list[str | None] = ["absent"] * len(keys)
        shown: set[int] = set()  # layer-wise: keys with bytes named in place
        keyless: dict[str, set[int]] = {}  # tier -> keys it holds sealed, with no secret here to open them
        served: list[str | None] = [None] * len(keys)
        waited = CopyWait()  # (one wait for this read's copies up past the budget, into every tier)
        for i, gone in enumerate(self.invalidations.suppressed(keys)):
            if gone:
                reasons[i] = "invalidated"
                self.metrics.miss("host", "invalidated")
        for depth, tier in enumerate(self.tiers):
            pending = [i for i, r in enumerate(reasons) if r not in (None, "invalidated") and i not in shown]
            if not pending:
                break
            above = [t for t in self.tiers[:depth] if t.policy != "off"]
            sub_keys, sub_outs = [keys[i] for i in pending], [outs[i] for i in pending]
            if on_ready is None:
                got, blobs = tier.read_into(sub_keys, sub_outs, keep_blobs=bool(above), tenant=tenant)
            else:
                def told(ready: list[int], end: int, p: list[int] = pending) -> None:
                    named = [p[j] for j in ready]
                    if end > 0:
                        shown.update(named)
                    on_ready(named, end)

                got, blobs = tier.read_layered(sub_keys, sub_outs, told, keep_blobs=bool(above), tenant=tenant)
            for i, reason in zip(pending, got):
                if reason is None:
                    served[i] = tier.name
                elif reason == "no_key":
                    keyless.setdefault(tier.name, set()).add(i)
                if reason is None or reasons[i] == "absent":
                    reasons[i] = reason  # keep the first real failure reason for the report
            up = {i: blob for i, blob in zip(pending, blobs) if blob is not None}
            if up:
                self._copy_up(keys, counts, tenant, up, above, keyless, waited)
        return reasons, served

    def _copy_up(self, keys: Sequence[bytes], counts: Sequence[int], tenant: bytes,
                 blobs: dict[int, bytes], above: list[EncodedTier], keyless: dict[str, set[int]],
                 waited: CopyWait) -> None:
        """Queue blocks read from a lower tier (index -> validated stored bytes) for the tiers
        above it that admit them: a remote hit warms the disk tier, as write-behind the load does
        not wait for (:mod:`tiered_kv.store.copies_up`). A key withdrawn before the copy is
        queued is not copied; one withdrawn after is deleted once the copy is written (the copy
        is a tracked write). A tier that holds a block sealed under a secret this replica does
        not have (``keyless``) keeps it: it serves the replicas that have one."""
        picked = list(blobs)
        live = [(keys[i], counts[i]) for i, gone in
                zip(picked, self.invalidations.suppressed([keys[i] for i in picked])) if not gone]
        by_key = {keys[i]: blobs[i] for i in picked}
        groups = self.saver.admitted([k for k, _ in live], above, [n for _, n in live])
        index = {keys[i]: i for i in picked}
        for tiers, group in groups.items():
            for tier in tiers:
                sealed = keyless.get(tier.name, ())
                items = [(k, by_key[k]) for k in group if index[k] not in sealed]
                if items:
                    self.copies.queue(items, tier, tenant, waited)
