"""Operations that change a store: ``evict`` (by size, age or namespace) and ``copy`` (blocks
and their namespace records from one medium to another, e.g. warm a Redis from an LMDB, or
export to a ``file://`` directory). Both only ever delete or copy whole entries; ``copy`` puts each
block for the tenant its source stores it for, and namespace records without a salt."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tiered_kv.admin.block_checks import check_block
from tiered_kv.admin.catalog import (
    READ_BATCH,
    UNREADABLE,
    Entry,
    entries,
    kind_of,
    metas_of,
    unreadable,
)
from tiered_kv.admin.opening import Tier
from tiered_kv.errors import ConfigError, CorruptBlock
from tiered_kv.keys import Namespace
from tiered_kv.store.records import NAMESPACE_PREFIX, decode_namespace, namespace_key, scrubbed, split_key

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]  # (advance, total)


def evict_plan(tier: Tier, *, to: int | None = None, older_than: float | None = None,
               namespace: bytes | None = None, now: float | None = None) -> tuple[list[Entry], int]:
    """(blocks to evict, least recently used first; stored bytes of the whole tier now)."""
    if to is None and older_than is None and namespace is None:
        raise ConfigError("evict needs --to SIZE, --older-than AGE or --namespace NS")
    now = time.time() if now is None else now
    listing = list(entries(tier.backend))
    used = sum(e.size or 0 for e in listing)
    chosen = [e for e in listing if e.kind == "block" and (namespace is None or e.namespace == namespace)]
    if older_than is not None:
        chosen = [e for e in chosen if e.age_basis is not None and now - e.age_basis >= older_than]
    chosen.sort(key=lambda e: (e.age_basis or 0.0, e.key))
    if to is not None:
        left, keep = used, []
        for e in chosen:
            if left <= to:
                break
            keep.append(e)
            left -= e.size or 0
        chosen = keep
    return chosen, used


def evict(tier: Tier, *, to: int | None = None, older_than: float | None = None,
          namespace: bytes | None = None, dry_run: bool = False, progress: Progress | None = None) -> dict:
    chosen, used = evict_plan(tier, to=to, older_than=older_than, namespace=namespace)
    keys = [e.key for e in chosen]
    if namespace is not None and to is None and older_than is None:
        keys.append(namespace_key(namespace))  # the whole namespace goes: its record too
    freed = sum(e.size or 0 for e in chosen)
    removed = 0
    if not dry_run:
        for start in range(0, len(keys), READ_BATCH):
            batch = keys[start : start + READ_BATCH]
            removed += tier.backend.delete_many(batch)
            if progress is not None:
                progress(len(batch), len(keys))
        tier.backend.flush()
        log.info("%s tier: evicted %d blocks (%d bytes)", tier.name, len(chosen), freed)
    return {"tier": tier.name, "url": tier.shown_url, "dry_run": dry_run,
            "order": "last access" if any(e.last_access is not None for e in chosen) else "creation",
            "evicted_blocks": len(chosen), "removed_entries": removed, "freed_bytes": freed,
            "stored_bytes_before": used, "stored_bytes_after": used - freed,
            "keys": [k.hex() for k in keys] if dry_run else None}


def copy(src: Tier, dst: Tier, *, namespace: bytes | None = None, overwrite: bool = False,
         verify: bool = True, progress: Progress | None = None) -> dict:
    """Copy every block (of ``namespace``) and its namespace record from ``src`` to ``dst``.
    Blocks are validated on the way (fully decoded with ``verify``, else their header only),
    against their namespace record's block when the source has one (a block of another shape,
    dtype or size is corrupt) and with the declared size bounded otherwise: corrupt ones are
    skipped and reported, never copied, as are blocks the source lists but cannot read (an LMDB
    value whose segment file is cut short). Evictions at the destination are counted from before
    the namespace records are put (a tool's open of an LMDB store evicts nothing)."""
    keys = [k for k in sorted(src.backend.scan())
            if kind_of(k) == "block" and (namespace is None or k.startswith(namespace))]
    digests = sorted({split_key(k)[0] for k in keys} | ({namespace} if namespace else set()))
    records = [(k, scrubbed(k, v) or v) for k, v in zip(map(namespace_key, digests), src.backend.get_many(
        [namespace_key(d) for d in digests])) if v is not None]  # (an older version's: without its salt)
    before = dst.backend.stats().evictions  # (the records' puts count too)
    if records:
        dst.backend.put_many(records)
    recorded = {k[len(NAMESPACE_PREFIX):]: _namespace_of(k, v) for k, v in records}
    copied = present = rejected = nbytes = 0
    corrupt: dict[str, str] = {}  # key (hex) -> why it was not copied
    lost: dict[str, str] = {}  # the same, for blocks listed but unreadable
    for start in range(0, len(keys), READ_BATCH):
        batch = keys[start : start + READ_BATCH]
        if not overwrite:
            have = dst.backend.contains_many(batch)
            present += sum(have)
            batch_todo = [k for k, h in zip(batch, have) if not h]
        else:
            batch_todo = batch
        good = []
        values = src.backend.get_many(batch_todo)
        for key in unreadable(src.backend, [k for k, v in zip(batch_todo, values) if v is None]):
            lost[key.hex()] = UNREADABLE  # the others are gone since the scan
            log.warning("copy: skipped %s: %s", key.hex(), UNREADABLE)
        for key, value in zip(batch_todo, values):
            if value is None:
                continue
            try:  # against its namespace's block (from the record), else with its size bounded
                check_block(key, value, recorded.get(split_key(key)[0]), decode=verify)
            except CorruptBlock as exc:
                corrupt[key.hex()] = exc.detail
                log.warning("copy: skipped %s: %s", key.hex(), exc.detail)
                continue
            good.append((key, value))
        stored = _put_as_theirs(src, dst, good)
        copied += sum(stored)
        rejected += len(stored) - sum(stored)
        nbytes += sum(len(v) for (_, v), s in zip(good, stored) if s)
        if progress is not None:
            progress(len(batch), len(keys))
    dst.backend.flush()
    return {"source": src.shown_url, "destination": dst.shown_url, "blocks": len(keys),
            "copied": copied, "copied_bytes": nbytes, "already_present": present,
            "corrupt_skipped": list(corrupt), "corrupt_details": corrupt, "unreadable_skipped": list(lost),
            "unreadable_details": lost, "rejected": rejected,
            "namespace_records": len(records),
            "evicted_at_destination": dst.backend.stats().evictions - before}


def tenants_of(backend, keys: list[bytes]) -> list[bytes]:
    """The tenant label each of ``keys`` is stored for, from the medium's meta data where it
    keeps one (LMDB, file); ``b""`` where it keeps none (Redis) or the key is gone."""
    return [bytes(m.get("tenant") or b"") if isinstance(m, dict) else b"" for m in metas_of(backend, keys)]


def _put_as_theirs(src: Tier, dst: Tier, items: list[tuple[bytes, bytes]]) -> list[bool]:
    """Put ``items`` into ``dst`` each for the tenant it is stored for in ``src`` (so the
    destination's usage per tenant and quotas follow them); stored or not, in order."""
    groups: dict[bytes, list[int]] = {}
    for i, tenant in enumerate(tenants_of(src.backend, [k for k, _ in items])):
        groups.setdefault(tenant, []).append(i)
    stored = [False] * len(items)
    for tenant, where in groups.items():
        for i, ok in zip(where, dst.backend.put_many([items[i] for i in where], tenant=tenant)):
            stored[i] = ok
    return stored


def _namespace_of(key: bytes, value) -> Namespace | None:
    try:
        return decode_namespace(key, value)
    except CorruptBlock:
        return None
