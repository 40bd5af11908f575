"""Operations that change a store: ``evict`` (by size, age or namespace) and ``copy`` (blocks
and their namespace records from one medium to another, e.g. warm a Redis from an LMDB, or
export to a ``file://`` directory). Both only ever delete or copy whole entries; ``copy`` puts each
block for the tenant its source stores it for, and namespace records without a salt."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from storage_backends.cas_delete import delete_if_unchanged
from tiered_kv.admin.block_checks import check_block
from tiered_kv.admin.catalog import (
    OTHER_STORE,
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
from tiered_kv.store.codec import HEADER_BYTES, MAX_RAW_BYTES, BlockCodec
from tiered_kv.store.records import decode_namespace, namespace_key, scrubbed, split_key

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]  # (advance, total)


def evict_plan(tier: Tier, *, to: int | None = None, older_than: float | None = None,
               namespace: bytes | None = None, now: float | None = None) -> tuple[list[Entry], int]:
    """(blocks to evict, least recently used first; stored bytes of the whole tier now)."""
    if to is None and older_than is None and namespace is None:
        raise ConfigError("evict needs --to SIZE, --older-than AGE or --namespace NS")
    now = time.time() if now is None else now
    listing = [e for e in entries(tier.backend) if e.kind != OTHER_STORE]  # (not ours to count)
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
    against their namespace's block when either store has a valid record of it (a block of another
    shape, dtype or size is corrupt) and with the declared size bounded otherwise: corrupt ones are
    skipped and reported, never copied, as are blocks the source lists but cannot read (an LMDB
    value whose segment file is cut short). A block the source no longer holds as it was read once
    the destination took it (a serving engine withdrew it, or evicted or rewrote it) is taken back
    from the destination where that still holds the copied bytes (``changed_at_source``): a
    withdrawn block is never re-created there. (An engine withdrawing from both stores deletes
    from them in its tiers' order: when the destination is its earlier tier, a copy put and checked
    between those two deletes is not noticed.) The destination's own namespace records are kept
    (with its engine's restore estimates; only an older version's salt is taken out): a record is
    copied where the destination has none or one that does not decode, and never one that does not
    decode itself. Evictions at the destination are counted from before the namespace records are
    put (a tool's open of an LMDB store evicts nothing). ``overwrite`` replaces a destination's
    block only with one sealed alike: an encrypted block is never replaced by a plain one (its
    engines encrypt: they would count it ``unencrypted`` and recompute), nor a plain one by an
    encrypted one (engines without a secret count it ``no_key`` and never replace it); those are
    kept and counted (``encrypted_kept``, ``unencrypted_kept``). Which secret sealed a block
    cannot be told without it: an encrypted block is replaced by any encrypted one."""
    keys = [k for k in sorted(src.backend.scan())
            if kind_of(k) == "block" and (namespace is None or k.startswith(namespace))]
    digests = sorted({split_key(k)[0] for k in keys} | ({namespace} if namespace else set()))
    before = dst.backend.stats().evictions  # (the records' puts count too)
    records = _records(src, dst, digests)
    if records.puts:
        dst.backend.put_many(records.puts)
    copied = present = rejected = nbytes = 0
    kept = {True: 0, False: 0}  # the destination's blocks kept, by whether they are sealed
    corrupt: dict[str, str] = {}  # key (hex) -> why it was not copied
    lost: dict[str, str] = {}  # the same, for blocks listed but unreadable
    changed: list[str] = []  # copied, then taken back: the source's value changed or went meanwhile
    for start in range(0, len(keys), READ_BATCH):
        batch = keys[start : start + READ_BATCH]
        if not overwrite:
            have = dst.backend.contains_many(batch)
            present += sum(have)
            batch_todo = [k for k, h in zip(batch, have) if not h]
        else:
            batch_todo = batch
        good, sealed = [], []
        values = src.backend.get_many(batch_todo)
        for key in unreadable(src.backend, [k for k, v in zip(batch_todo, values) if v is None]):
            lost[key.hex()] = UNREADABLE  # the others are gone since the scan
            log.warning("copy: skipped %s: %s", key.hex(), UNREADABLE)
        for key, value in zip(batch_todo, values):
            if value is None:
                continue
            try:  # against its namespace's block (from a record), else with its size bounded
                checked = check_block(key, value, records.layouts.get(split_key(key)[0]), decode=verify)
            except CorruptBlock as exc:
                corrupt[key.hex()] = exc.detail
                log.warning("copy: skipped %s: %s", key.hex(), exc.detail)
                continue
            good.append((key, value))
            sealed.append((checked[0] if verify else checked).sealed)
        if overwrite and good:
            good = _sealed_alike(dst, good, sealed, kept)
        stored = _put_as_theirs(src, dst, good)
        rejected += len(stored) - sum(stored)
        put = [item for item, s in zip(good, stored) if s]
        gone = _taken_back(src, dst, put)
        changed += [k.hex() for k in gone]
        copied += len(put) - len(gone)
        nbytes += sum(len(v) for k, v in put if k not in gone)
        if progress is not None:
            progress(len(batch), len(keys))
    dst.backend.flush()
    return {"source": src.shown_url, "destination": dst.shown_url, "blocks": len(keys),
            "copied": copied, "copied_bytes": nbytes, "already_present": present,
            "corrupt_skipped": list(corrupt), "corrupt_details": corrupt, "unreadable_skipped": list(lost),
            "unreadable_details": lost, "rejected": rejected, "changed_at_source": changed,
            "encrypted_kept": kept[True], "unencrypted_kept": kept[False],
            "namespace_records": records.copied, "namespace_records_kept": records.kept,
            "broken_namespace_records": records.broken,
            "evicted_at_destination": dst.backend.stats().evictions - before}


@dataclass
class _Records:
    """What ``copy`` does with the namespace records of the digests it copies."""

    puts: list[tuple[bytes, bytes]] = field(default_factory=list)  # into the destination
    layouts: dict[bytes, Namespace | None] = field(default_factory=dict)  # from either's valid record
    copied: int = 0  # the source's records put
    kept: int = 0  # valid records of the destination's own, left as they are (or without a salt)
    broken: dict[str, str] = field(default_factory=dict)  # the source's that do not decode: hex -> why


def _records(src: Tier, dst: Tier, digests: list[bytes]) -> _Records:
    """The destination's valid record stays (its engine's estimates in it; an older version's is
    put back without its salt); else the source's valid one is copied (without an older version's
    salt); a record that does not decode never is."""
    keys = [namespace_key(d) for d in digests]
    out = _Records()
    for d, key, theirs, ours in zip(digests, keys, src.backend.get_many(keys), dst.backend.get_many(keys)):
        (source, why), (own, _) = _namespace_of(key, theirs), _namespace_of(key, ours)
        out.layouts[d] = source or own
        if why is not None:
            out.broken[d.hex()] = why
            log.warning("copy: namespace record %s not copied: %s", d.hex(), why)
        if own is not None:
            out.kept += 1
            if (clean := scrubbed(key, ours)) is not None:
                out.puts.append((key, clean))
        elif source is not None:
            out.copied += 1
            out.puts.append((key, scrubbed(key, theirs) or theirs))
    return out


def _sealed_alike(dst: Tier, good: list[tuple[bytes, bytes]], sealed: list[bool],
                  kept: dict[bool, int]) -> list[tuple[bytes, bytes]]:
    """Those of ``good`` (with whether each is ``sealed``) the destination holds none of, or one
    sealed alike (or one whose header does not read: replaced, as a broken block is); the others
    are counted in ``kept`` by whether the destination's block is sealed."""
    theirs = sealed_at(dst.backend, [k for k, _ in good])
    out = []
    for item, mine, held in zip(good, sealed, theirs):
        if held is None or held == mine:
            out.append(item)
        else:
            kept[held] += 1
            log.info("copy: kept %s: the destination's block is %s, the source's is not", item[0].hex(),
                     "encrypted" if held else "unencrypted")
    return out


def sealed_at(backend, keys: list[bytes]) -> list[bool | None]:
    """Whether each of ``keys`` is held sealed (encrypted), from its header alone; None where the
    medium holds none or one whose header does not read."""
    out: list[bool | None] = [None] * len(keys)

    def visit(sizes, reader) -> None:
        for i, size in enumerate(sizes):
            head = bytearray(HEADER_BYTES)
            if size is None or size < HEADER_BYTES or reader.read(i, 0, head) is not True:
                continue
            digest, block = split_key(keys[i])
            try:
                out[i] = BlockCodec.read_header(head, namespace=digest, key=block, max_raw=MAX_RAW_BYTES,
                                                total_len=size).sealed
            except CorruptBlock:
                continue

    backend.visit_ranges(keys, visit)
    return out


def _taken_back(src: Tier, dst: Tier, put: list[tuple[bytes, bytes]]) -> set[bytes]:
    """Those of ``put`` (just stored in ``dst``) that ``src`` no longer holds as they were read
    (withdrawn by a serving engine, evicted or rewritten since), each deleted from ``dst`` when it
    still holds the copied bytes (a serving engine may have stored its own since: kept, even when
    stored just before the delete, on the media with delete-if-unchanged)."""
    if not put:
        return set()
    now = src.backend.get_many([k for k, _ in put])
    stale = [(k, v) for (k, v), n in zip(put, now) if n is None or bytes(n) != bytes(v)]
    if not stale:
        return set()
    if delete_if_unchanged(dst.backend, stale) is None:  # (a medium without it: a put between
        held = dst.backend.get_many([k for k, _ in stale])  # this read and the delete is lost)
        ours = [k for (k, v), h in zip(stale, held) if h is not None and bytes(h) == bytes(v)]
        if ours:
            dst.backend.delete_many(ours)
    log.info("copy: %d blocks changed at the source while being copied: not copied", len(stale))
    return {k for k, _ in stale}


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


def _namespace_of(key: bytes, value) -> tuple[Namespace | None, str | None]:
    """(the namespace a stored record describes, None when there is none or it does not decode;
    why it does not)."""
    if value is None:
        return None, None
    try:
        return decode_namespace(key, value), None
    except CorruptBlock as exc:
        return None, exc.detail
