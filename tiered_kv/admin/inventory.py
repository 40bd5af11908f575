"""Reports on what a store holds: the per-tier, per-namespace summary (``inspect``), filtered
listings (``ls``) and one block in detail (``show``, with per-layer K/V statistics)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from tiered_kv.admin.block_checks import block_layout, check_block
from tiered_kv.admin.catalog import (
    OTHER_STORE,
    UNREADABLE,
    Entry,
    Namespaces,
    block_digests,
    entries,
    namespaces,
    resolve_namespace,
    sample_header,
    unreadable,
)
from tiered_kv.admin.opening import Tier
from tiered_kv.admin.tenants import default_quota, tenant_usage
from tiered_kv.dtypes import torch_dtype
from tiered_kv.errors import ConfigError, CorruptBlock
from tiered_kv.keys import KEY_BYTES
from tiered_kv.store.records import split_key

# last-access age buckets: (label, upper bound in seconds)
AGE_BUCKETS = (("<1m", 60), ("<1h", 3600), ("<1d", 86400), ("<7d", 7 * 86400), (">=7d", float("inf")))


def iso(ts: float | None) -> str | None:
    """``ts`` (epoch seconds) in ISO 8601, UTC; None when unknown or no time at all (a header's
    created time is not checked by the codec: a NaN, infinite or out-of-range one made ``show``
    fail with a traceback)."""
    try:
        return None if ts is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))
    except (ValueError, OverflowError, OSError):
        return None


def age_bucket(age: float) -> str:
    return next(label for label, bound in AGE_BUCKETS if age < bound)


# -- inspect ----------------------------------------------------------------------------------
def inspect_tier(tier: Tier, now: float | None = None) -> dict:
    """Blocks, tokens, bytes, ratio, model and shape, oldest/newest and last-access ages per
    namespace of one tier, and the tier's totals, capacity use and usage per tenant."""
    now = time.time() if now is None else now
    found = namespaces(tier.backend)
    listing = list(entries(tier.backend))
    per_ns: dict[bytes, list[Entry]] = {}
    kinds = Counter(e.kind for e in listing)
    for e in listing:
        if e.kind == "block":
            per_ns.setdefault(e.namespace, []).append(e)
    keys = [e.key for e in listing]
    report = {}
    for digest in sorted(per_ns.keys() | found.known.keys()):
        report[digest.hex()] = _namespace_summary(tier, digest, per_ns.get(digest, []), found, keys, now)
    stats = tier.backend.stats()
    stored = sum(e.size or 0 for e in listing if e.kind != OTHER_STORE)
    return {
        "tier": tier.name, "url": tier.shown_url, "medium": tier.backend.name,
        "entries": len(listing) - kinds[OTHER_STORE], "blocks": kinds["block"], "namespace_records": kinds["namespace"],
        "foreign_entries": kinds["foreign"], "other_store_entries": kinds[OTHER_STORE], "stored_bytes": stored,
        "used_bytes": stats.used_bytes, "capacity_bytes": tier.capacity,
        "capacity_used": round(stats.used_bytes / tier.capacity, 4) if tier.capacity else None,
        "tenants": tenant_usage(tier), "tenant_quota_bytes": default_quota(tier),
        "broken_namespace_records": {d.hex(): why for d, why in found.broken.items()},
        "namespaces": report,
    }


def _namespace_summary(tier: Tier, digest: bytes, blocks: list[Entry], found: Namespaces,
                       keys: list[bytes], now: float) -> dict:
    ns = found.known.get(digest)
    out: dict = {"record": ns is not None, "model_id": ns.model_id if ns else None}
    if ns is not None:
        out.update(dtype=ns.dtype, block_size=ns.block_size, block_shape=list(ns.block_shape),
                   revision=ns.revision, tp=f"{ns.tp_rank}/{ns.tp_size}", cache_salt=bool(ns.cache_salt),
                   hash_algo=ns.hash_algo, layout=ns.layout)
        if ns.groups:  # entries hold every group's part; with state groups, state entries count too
            out["groups"] = [g.describe() for g in ns.groups]
        raw_each, block_size = block_layout(ns).raw_len, (None if ns.has_state else ns.block_size)
    else:  # no record: dtype and shape from a block's header; tokens unknown
        header = sample_header(tier.backend, digest, keys)
        raw_each = header.raw_len if header else None
        block_size = header.shape[2] if header and len(header.shape) == 5 else None
        if header is not None:
            out.update(dtype=header.dtype, block_shape=list(header.shape))
    stored = sum(e.size or 0 for e in blocks)
    raw = sum(e.header.raw_len if e.header else (raw_each or 0) for e in blocks)
    created = [e.created for e in blocks if e.created is not None]
    ages = Counter(age_bucket(now - e.last_access) for e in blocks if e.last_access is not None)
    out.update(
        blocks=len(blocks), tokens=len(blocks) * block_size if block_size else None,
        raw_bytes=raw if raw_each or any(e.header for e in blocks) else None, stored_bytes=stored,
        compression_ratio=round(raw / stored, 4) if stored and raw else None,
        oldest=iso(min(created)) if created else None, newest=iso(max(created)) if created else None,
        last_access_age={label: ages[label] for label, _ in AGE_BUCKETS} if ages else None,
        hits=sum(e.hits for e in blocks if e.hits is not None) if any(e.hits is not None for e in blocks) else None,
    )
    return out


# -- ls ---------------------------------------------------------------------------------------
@dataclass
class Filter:
    namespace: bytes | None = None
    older_than: float | None = None  # seconds since last access (or creation)
    newer_than: float | None = None
    min_size: int | None = None
    max_size: int | None = None
    include_all: bool = False  # namespace records and foreign entries too

    def accepts(self, e: Entry, now: float) -> bool:
        if not self.include_all and e.kind != "block":
            return False
        if self.namespace is not None and e.namespace != self.namespace:
            return False
        age = None if e.age_basis is None else now - e.age_basis
        if self.older_than is not None and (age is None or age < self.older_than):
            return False
        if self.newer_than is not None and (age is None or age >= self.newer_than):
            return False
        if self.min_size is not None and (e.size or 0) < self.min_size:
            return False
        return self.max_size is None or (e.size or 0) <= self.max_size


SORTS = {"key": lambda e: e.key, "size": lambda e: e.size or 0,
         "created": lambda e: e.created or 0.0, "access": lambda e: e.age_basis or 0.0}


def list_entries(tier: Tier, flt: Filter, *, sort: str = "key", offset: int = 0,
                 limit: int | None = None, now: float | None = None) -> tuple[int, list[dict]]:
    """(entries matching ``flt``, the page ``offset .. offset+limit`` of them as rows)."""
    now = time.time() if now is None else now
    found = namespaces(tier.backend)
    hits = sorted((e for e in entries(tier.backend) if flt.accepts(e, now)), key=SORTS[sort])
    page = hits[offset : None if limit is None else offset + limit]
    return len(hits), [entry_row(tier, e, found, now) for e in page]


def entry_row(tier: Tier, e: Entry, found: Namespaces, now: float) -> dict:
    return {
        "tier": tier.name, "key": e.key.hex(), "kind": e.kind,
        "namespace": e.namespace.hex() if e.namespace else None,
        "model_id": found.describe(e.namespace) if e.namespace else None,
        "size": e.size, "created": iso(e.created), "last_access": iso(e.last_access),
        "age_s": None if e.age_basis is None else round(now - e.age_basis, 3), "hits": e.hits,
    }


# -- show -------------------------------------------------------------------------------------
def find_key(tiers: Iterable[Tier], spec: str, namespace: str | None = None) -> tuple[Tier, bytes]:
    """The tier and full key that ``spec`` names: the whole key in hex, a unique hex prefix of
    it (8+ characters), or a 32-hex block key (with ``namespace`` when several are stored)."""
    spec = spec.strip().lower()
    try:
        bytes.fromhex(spec if len(spec) % 2 == 0 else spec + "0")
    except ValueError:
        raise ConfigError(f"KEY must be hexadecimal, got {spec!r}") from None
    if len(spec) < 8:
        raise ConfigError("KEY needs at least 8 hex characters")
    matches = []
    for tier in tiers:
        keys = list(tier.backend.scan())
        found = [k for k in keys if k.hex().startswith(spec)]
        if len(spec) == 2 * KEY_BYTES and len(found) != 1:  # a block key without its namespace
            digest = resolve_namespace(namespace, namespaces(tier.backend), block_digests(keys))
            found = [k for k in keys if k == digest + bytes.fromhex(spec)]
        matches += [(tier, k) for k in found]
    if not matches:
        raise LookupError(f"no entry with key {spec}")
    if len({k for _, k in matches}) > 1:
        raise ConfigError(f"key prefix {spec} matches {len(matches)} entries; give more characters")
    return matches[0]


def show_entry(tier: Tier, key: bytes, *, stats: bool = True) -> dict:
    """Header fields, medium meta data and (for a valid block) per-layer K/V statistics."""
    found = namespaces(tier.backend)
    [entry] = list(entries(tier.backend, headers=True, keys=[key])) or [None]
    if entry is None:
        raise LookupError(f"entry {key.hex()} vanished")
    out: dict = {"tier": tier.name, "url": tier.shown_url, "kind": entry.kind, "key": key.hex(),
                 "size": entry.size, "created": iso(entry.created), "last_access": iso(entry.last_access),
                 "hits": entry.hits}
    if entry.kind != "block":
        return _unreadable(out, entry.unreadable)
    digest = split_key(key)[0]
    out["namespace"] = digest.hex()
    out["model_id"] = found.known[digest].model_id if digest in found.known else None
    if digest in found.known and found.known[digest].groups:
        ns = found.known[digest]
        plan = ns.entry_plan
        out["groups"] = [{**g.describe(), "entry": "state" if g.is_state else "block",
                          "bytes": [plan.offsets[i], plan.offsets[i] + plan.sizes[i]]}
                         for i, g in enumerate(ns.groups)]
    if entry.unreadable:
        return _unreadable(out, True)
    h = entry.header
    if h is not None:
        out["header"] = {
            "version": h.version, "codec": h.codec, "level": h.level, "dtype": h.dtype,
            "shape": list(h.shape), "namespace": h.namespace.hex(), "key": h.key.hex(),
            "raw_len": h.raw_len, "stored_len": h.stored_len, "ratio": round(h.ratio, 4),
            "checksum": f"{h.checksum:016x}", "body_check": f"{h.body_check:08x}", "created": iso(h.created),
            "encrypted": h.sealed,
        }
    [value] = tier.backend.get_many([key])
    if value is None and unreadable(tier.backend, [key]):  # listed still: not vanished
        return _unreadable(out, True)
    if value is None:
        raise LookupError(f"entry {key.hex()} vanished")
    try:  # against its namespace's block: a lying header never makes us allocate what it declares
        header, payload = check_block(key, value, found.known.get(digest))
    except CorruptBlock as exc:
        out.update(valid=False, reason=exc.reason, error=exc.detail)
        return out
    out["valid"] = True
    if stats and payload is not None:  # an encrypted block's payload needs its key
        out["layers"] = layer_stats(payload, header.dtype, header.shape)
    return out


def _unreadable(out: dict, unreadable: bool) -> dict:
    """``out``, reporting (when ``unreadable``) an entry listed whose value cannot be read."""
    if unreadable:
        out.update(valid=False, reason="unreadable", error=UNREADABLE)
    return out


def as_float(payload: memoryview, dtype: str) -> np.ndarray:
    """The payload as float32 (bfloat16 by its high half; float8 through torch)."""
    buf = np.frombuffer(payload, dtype=np.uint8)
    if dtype == "bfloat16":
        return (buf.view("<u2").astype(np.uint32) << 16).view(np.float32)
    if dtype.startswith("float8"):
        import torch  # numpy has no float8

        return torch.frombuffer(bytearray(buf), dtype=torch_dtype(dtype)).float().numpy()
    return buf.view(np.dtype(dtype).newbyteorder("<")).astype(np.float32)


def layer_stats(payload: memoryview, dtype: str, shape: tuple[int, ...]) -> list[dict]:
    """min/max/mean/std and NaN/Inf counts of K and V per layer (canonical [L, 2, ...] layout;
    the whole block as one row for other shapes). Statistics skip non-finite values."""
    values = as_float(payload, dtype)
    groups = values.reshape(shape[0], 2, -1) if len(shape) >= 2 and shape[1] == 2 else values.reshape(1, 1, -1)
    rows = []
    for layer, pair in enumerate(groups):
        for part, data in zip("KV" if len(pair) == 2 else "*", pair):
            finite = data[np.isfinite(data)]
            rows.append({
                "layer": layer, "part": part,
                "min": float(finite.min()) if finite.size else None,
                "max": float(finite.max()) if finite.size else None,
                "mean": float(finite.mean(dtype=np.float64)) if finite.size else None,
                "std": float(finite.std(dtype=np.float64)) if finite.size else None,
                "nan": int(np.isnan(data).sum()), "inf": int(np.isinf(data).sum()),
            })
    return rows
