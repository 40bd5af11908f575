"""``verify``: decode every stored block and report what is wrong, optionally fixing it.

Findings:

- ``corrupt``: a block (or namespace record) that fails validation — header, body check, zstd
  frame or payload checksum, or a header declaring more than its body can hold (or, for a block
  of unknown namespace, more than MAX_RAW_BYTES): nothing a header declares is allocated unchecked;
- ``mismatched``: a valid block stored under a key other than the one its header names, or whose
  dtype / shape differ from its namespace record;
- ``orphaned``: an entry that is neither a block nor a namespace record (nothing ever reads it);
- ``meta_drift``: the medium's own bookkeeping disagrees with its contents (LMDB meta / LRU /
  totals tables, leftover temporary files of the file medium), from the backend's ``check``.
  What that check could not look at (an older format's store opened read-only keeps no tenant
  tables until its first write) is a note, not a finding; with ``fix`` (a write: the format is
  upgraded first) it is checked too.

``fix`` deletes corrupt, mismatched and orphaned entries (the engine recomputes those blocks)
and lets the backend repair its bookkeeping; the report says what was done. Each entry is read
and judged again just before its delete: a serving process may have replaced it meanwhile (an
engine that read the corrupt block removed it and stored the block it recomputed), and that
good block is left alone. The delete itself removes an entry only while it still holds the value
judged (:mod:`storage_backends.cas_delete`: LMDB, Redis, file): a block stored between that read
and the delete is kept too (a medium without such a delete still deletes it). Entries of another
store kept under a longer prefix of the same medium (a Redis ``prefix`` extending this one) are
a note, never orphans. Namespace records an older version wrote with the ``cache_salt`` in them
are a note (the salt is never shown), and ``fix`` rewrites them without it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass

from storage_backends.base import Unchecked
from storage_backends.cas_delete import delete_if_unchanged
from tiered_kv.admin.block_checks import check_block
from tiered_kv.admin.catalog import READ_BATCH, kind_of, namespaces, of_another_store
from tiered_kv.admin.opening import Tier
from tiered_kv.errors import CorruptBlock
from tiered_kv.store.codec import BlockCodec
from tiered_kv.store.records import decode_namespace, namespace_key, scrubbed, split_key

log = logging.getLogger(__name__)

REMOVABLE = ("corrupt", "mismatched", "orphaned")


@dataclass
class Finding:
    tier: str
    kind: str  # corrupt | mismatched | orphaned | meta_drift
    key: str | None  # hex; None for findings about the medium as a whole
    detail: str
    fixed: bool = False


def verify_tier(tier: Tier, *, fix: bool = False, progress: Callable[[int, int], None] | None = None) -> dict:
    backend = tier.backend
    codec = BlockCodec()
    found = namespaces(backend)
    findings = [Finding(tier.name, "corrupt" if "unreadable" in why else "mismatched",
                        namespace_key(d).hex(), f"namespace record: {why}")
                for d, why in found.broken.items()]
    keys = sorted(backend.scan())
    blocks: Counter = Counter()
    checked = elsewhere = 0
    salted: list[tuple[bytes, bytes]] = []  # (key, the record without its salt): records holding one
    for start in range(0, len(keys), READ_BATCH):
        batch = keys[start : start + READ_BATCH]
        for key, value in zip(batch, backend.get_many(batch)):
            if value is None:
                continue  # removed since the scan (evicted, or by a serving process)
            checked += 1
            kind = kind_of(key)
            if kind == "foreign" and of_another_store(key, value):
                elsewhere += 1  # (a store under a longer prefix of this medium: not an orphan)
            elif kind == "foreign":
                findings.append(Finding(tier.name, "orphaned", key.hex(),
                                        f"not a block nor a namespace record ({len(value)} bytes)"))
            elif kind == "block":
                problem = _check_block(codec, key, value, found.known.get(split_key(key)[0]))
                if problem is None:
                    blocks[split_key(key)[0]] += 1
                else:
                    findings.append(Finding(tier.name, problem[0], key.hex(), problem[1]))
            elif (clean := scrubbed(key, value)) is not None:  # (kind "namespace": a record)
                salted.append((key, clean))
        if progress is not None:
            progress(len(batch), len(keys))
    check = getattr(backend, "check", None)
    said = check(False) if check is not None else []
    if fix and any(isinstance(p, Unchecked) for p in said):
        said = check(True)  # a write: the older format is upgraded, then every table checked
    findings += [Finding(tier.name, "meta_drift", None, p) for p in said if not isinstance(p, Unchecked)]
    actions = _fix(tier, findings, found.known) if fix and findings else []
    if fix and salted:  # read again: one the fix removed, or a serving process rewrote since the scan
        salted = _still_salted(backend, [k for k, _ in salted])  # (its estimates in it) is left alone
    if fix and salted:
        done = sum(backend.put_many(salted))
        actions.append(f"rewrote {done} of {len(salted)} namespace records without their cache_salt")
    notes = [str(p) for p in said if isinstance(p, Unchecked)]
    if elsewhere:
        notes.append(f"{elsewhere} entries are another store's, under a longer prefix of this medium "
                     "(left alone)")
    if salted and not fix:
        notes.append(f"{len(salted)} namespace records hold their cache_salt in the clear (an older "
                     "version wrote them): verify --fix rewrites them without it")
    notes += [f"namespace {d.hex()} ({ns.model_id}) has a record but no blocks"
             for d, ns in found.known.items() if not blocks[d]]
    notes += [f"{n} blocks of namespace {d.hex()} have no namespace record (model id unknown)"
              for d, n in blocks.items() if d not in found.known and d not in found.broken]
    counts = Counter(f.kind for f in findings)
    return {
        "tier": tier.name, "url": tier.shown_url, "checked": checked, "valid_blocks": sum(blocks.values()),
        "namespaces": len(found.known), "problems": {k: counts[k] for k in (*REMOVABLE, "meta_drift")},
        "ok": not findings or all(f.fixed for f in findings),
        "findings": [asdict(f) for f in findings], "actions": actions, "notes": notes,
    }


def _check_block(codec: BlockCodec, key: bytes, value, ns) -> tuple[str, str] | None:
    digest, block = split_key(key)
    try:
        header = codec.read_header(value)
    except CorruptBlock as exc:
        return "corrupt", exc.detail
    if header.namespace != digest or header.key != block:
        return "mismatched", (f"header names namespace {header.namespace.hex()} key {header.key.hex()}"
                              f"{'' if header.namespace == digest else ' (another namespace)'}")
    if ns is not None and (header.dtype != ns.dtype or tuple(header.shape) != ns.block_shape):
        return "mismatched", (f"block is {header.dtype} {list(header.shape)}, its namespace record "
                              f"says {ns.dtype} {list(ns.block_shape)}")
    try:  # against the record's block when there is one, else with the declared size bounded
        check_block(key, value, ns)
    except CorruptBlock as exc:
        return "corrupt", exc.detail
    return None


def _still_salted(backend, keys: list[bytes]) -> list[tuple[bytes, bytes]]:
    """(key, the record without its salt) for each of ``keys`` whose record holds one now."""
    now = zip(keys, backend.get_many(keys))
    return [(k, clean) for k, v in now if v is not None and (clean := scrubbed(k, v)) is not None]


def _fix(tier: Tier, findings: list[Finding], known: dict) -> list[str]:
    actions = []
    doomed = [f for f in findings if f.kind in REMOVABLE]
    if doomed:
        keys = list(dict.fromkeys(bytes.fromhex(f.key) for f in doomed if f.key))
        removed = judged_wrong = spared = 0
        still: set[bytes] = set()
        for start in range(0, len(keys), READ_BATCH):
            # each batch judged again just before its own delete: the scan (and the batches
            # before) may have ended long ago (it used to delete blocks a serving process had
            # rewritten since with good ones, acknowledged to its engine; judging every entry
            # before deleting any left that window open for the whole re-read); the delete then
            # takes only the values judged (one rewritten since the re-read stays)
            batch = keys[start : start + READ_BATCH]
            wrong = _still_wrong(tier.backend, batch, known)
            if wrong:
                done = _delete_judged(tier.backend, wrong)
                removed += done
                spared += len(wrong) - done
                now = [k for k, _ in wrong]
                still |= {k for k, _ in _still_wrong(tier.backend, now, known)}
            judged_wrong += len(wrong)
        for f in doomed:
            f.fixed = bytes.fromhex(f.key) not in still
        actions.append(f"removed {removed} of {len(keys)} entries "
                       f"({', '.join(f'{n} {k}' for k, n in Counter(f.kind for f in doomed).items())})")
        if judged_wrong - spared < len(keys):
            actions.append(f"left {len(keys) - judged_wrong + spared} entries alone: rewritten with a valid "
                           "value or removed since they were checked (by a serving process)")
        log.info("%s tier: removed %d entries", tier.name, removed)
    drift = [f for f in findings if f.kind == "meta_drift"]
    check = getattr(tier.backend, "check", None)
    if check is not None and drift:
        check(True)
        left = check(False)
        for f in drift:
            f.fixed = f.detail not in left
        actions.append(f"repaired {sum(f.fixed for f in drift)} of {len(drift)} bookkeeping problems")
    return actions


def _still_wrong(backend, keys: list[bytes], known: dict) -> list[tuple[bytes, bytes]]:
    """(key, the value it holds now) for each of ``keys`` (found wrong by this run) holding a
    wrong value now; one gone, or rewritten with a valid value since, is left out."""
    codec = BlockCodec()
    out: list[tuple[bytes, bytes]] = []
    for start in range(0, len(keys), READ_BATCH):
        batch = keys[start : start + READ_BATCH]
        out += [(key, value) for key, value in zip(batch, backend.get_many(batch))
                if value is not None and _wrong(codec, key, value, known)]
    return out


def _delete_judged(backend, judged: list[tuple[bytes, bytes]]) -> int:
    """Delete the entries of ``judged`` that still hold the value judged; how many were deleted.
    A medium without delete-if-unchanged deletes the keys whatever they hold now."""
    done = delete_if_unchanged(backend, judged)
    if done is None:
        return backend.delete_many([k for k, _ in judged])
    return sum(done)


def _wrong(codec: BlockCodec, key: bytes, value, known: dict) -> bool:
    kind = kind_of(key)
    if kind == "block":
        return _check_block(codec, key, value, known.get(split_key(key)[0])) is not None
    if kind == "namespace":
        try:
            decode_namespace(key, value)
        except CorruptBlock:
            return True
        return False
    return True  # orphaned: whatever it holds, nothing reads it
