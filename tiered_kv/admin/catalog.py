"""What a store holds, as tools see it: its entries (blocks, namespace records, foreign keys)
with their sizes, times and hits, its namespace records, and which namespace a command-line
``--namespace`` names.

Listings leave LRU order alone where the medium allows it: the LMDB meta table gives sizes,
times and hits without reading blocks (and stores are opened so that tools' reads are not
recorded as accesses: ``opening``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from storage_backends.base import Backend
from tiered_kv.admin.opening import Tier
from tiered_kv.errors import ConfigError, CorruptBlock, DamagedRecord
from tiered_kv.keys import Namespace
from tiered_kv.store.codec import BlockCodec, BlockHeader
from tiered_kv.store.records import (
    DIGEST_BYTES,
    NAMESPACE_PREFIX,
    STORAGE_KEY_BYTES,
    decode_namespace,
    is_block_key,
    is_namespace_key,
    split_key,
)

READ_BATCH = 64  # values read per call when headers are needed
UNREADABLE = "the store lists it but cannot read its value (its segment file is gone or cut short)"
OTHER_STORE = "other_store"  # an entry of a store under a longer prefix (:func:`of_another_store`)
DAMAGED_META = "its meta record (size, times, tenant) cannot be read: verify --fix rebuilds it"


@dataclass
class Entry:
    """One stored value as tools see it."""

    key: bytes
    kind: str  # "block" | "namespace" (a namespace record) | "foreign" | OTHER_STORE
    size: int | None = None  # stored bytes
    created: float | None = None  # seconds since the epoch
    last_access: float | None = None  # seconds since the epoch (None: the medium does not say)
    hits: int | None = None
    header: BlockHeader | None = None  # when the value was read
    error: str | None = None  # why the header (or the value: ``unreadable``) could not be read
    unreadable: bool = False  # listed by the medium, but its value could not be read

    @property
    def namespace(self) -> bytes | None:
        return split_key(self.key)[0] if self.kind == "block" else None

    @property
    def age_basis(self) -> float | None:
        """Last access, or creation where the medium keeps no access time."""
        return self.last_access if self.last_access is not None else self.created


@dataclass
class Namespaces:
    """The namespace records of one tier, by digest (records that do not decode: ``broken``)."""

    known: dict[bytes, Namespace] = field(default_factory=dict)
    broken: dict[bytes, str] = field(default_factory=dict)

    def describe(self, digest: bytes) -> str:
        ns = self.known.get(digest)
        return ns.model_id if ns is not None else "?"


def kind_of(key: bytes) -> str:
    if is_block_key(key):
        return "block"
    return "namespace" if is_namespace_key(key) else "foreign"


def of_another_store(key: bytes, value) -> bool:
    """Whether the foreign entry ``key`` (holding ``value``) is another store's, kept under a
    longer prefix of the same medium (a Redis store of prefix ``tkv:team-b:`` lists under the
    default ``tkv:``): a key ending in a namespace record's key, or one ending in a block's
    storage key whose value is a block naming that key. Tools leave those alone (``verify --fix``
    deleted another deployment's blocks and records as orphans)."""
    tail = len(NAMESPACE_PREFIX) + DIGEST_BYTES
    if len(key) > tail and is_namespace_key(key[-tail:]):
        return True
    if len(key) <= STORAGE_KEY_BYTES or value is None:
        return False
    digest, block = split_key(key[-STORAGE_KEY_BYTES:])
    try:
        BlockCodec.read_header(value, namespace=digest, key=block)
    except CorruptBlock:
        return False
    return True


def namespaces(backend: Backend) -> Namespaces:
    keys = [k for k in backend.scan(NAMESPACE_PREFIX) if is_namespace_key(k)]
    out = Namespaces()
    for key, value in zip(keys, backend.get_many(keys)):
        digest = key[len(NAMESPACE_PREFIX):]
        if value is None:
            continue
        try:
            out.known[digest] = decode_namespace(key, value)
        except CorruptBlock as exc:
            out.broken[digest] = exc.detail
    return out


def metas_of(backend: Backend, keys: Sequence[bytes]) -> list[dict | str | None]:
    """:func:`meta_or_damage` of each of ``keys`` where the medium keeps meta data (LMDB, file;
    no batched form: a small read per key), else None each (Redis)."""
    meta_of = getattr(backend, "entry_meta", None)
    return [meta_or_damage(meta_of, k) for k in keys] if meta_of is not None else [None] * len(keys)


def meta_or_damage(meta_of, key: bytes) -> dict | str | None:
    """The medium's meta data of ``key`` (None: gone), or :data:`DAMAGED_META` when its record
    cannot be read (the entry is still listed, and copied, for what its value holds)."""
    try:
        return meta_of(key)
    except DamagedRecord:
        return DAMAGED_META


def entries(backend: Backend, *, headers: bool = False, keys: Sequence[bytes] | None = None) -> Iterator[Entry]:
    """Every entry (or those of ``keys``), with size and times from the medium's meta data where
    it keeps some (LMDB, file) and from block headers otherwise (Redis) or with ``headers``."""
    keys = sorted(backend.scan()) if keys is None else list(keys)
    kept = hasattr(backend, "entry_meta")
    for start in range(0, len(keys), READ_BATCH):
        batch = keys[start : start + READ_BATCH]
        metas = metas_of(backend, batch)
        read = headers or not kept or DAMAGED_META in metas  # (then its value says what is there)
        values = backend.get_many(batch) if read else [None] * len(batch)
        lost = set(unreadable(backend, [k for k, v in zip(batch, values) if read and v is None]))
        for key, meta, value in zip(batch, metas, values):
            if (value is None if read else meta is None) and key not in lost:
                continue  # deleted since the scan
            entry = Entry(key, kind_of(key))
            if entry.kind == "foreign" and of_another_store(key, value):
                entry.kind = OTHER_STORE
            if meta == DAMAGED_META:
                entry.error, meta = DAMAGED_META, None
            if key in lost:
                entry.error, entry.unreadable = UNREADABLE, True
            if meta is not None:
                entry.size, entry.hits = meta["size"], meta["hits"]
                entry.created = meta["created_ns"] / 1e9
                entry.last_access = meta["last_access_ns"] / 1e9
            if value is not None:
                entry.size = len(value)
                if entry.kind == "block":
                    _read_header(entry, value)
            yield entry


def unreadable(backend: Backend, keys: Sequence[bytes]) -> list[bytes]:
    """Those of ``keys`` (whose values just read as absent) that the medium still lists: not
    deleted since, but unreadable (an LMDB value whose segment file is gone or cut short)."""
    return [k for k, listed in zip(keys, backend.contains_many(keys)) if listed] if keys else []


def _read_header(entry: Entry, value: bytes) -> None:
    try:
        entry.header = BlockCodec.read_header(value)
    except CorruptBlock as exc:
        entry.error = exc.detail
        return
    if entry.created is None:
        entry.created = entry.header.created


def sample_header(backend: Backend, digest: bytes, keys: Sequence[bytes], tries: int = 4) -> BlockHeader | None:
    """The header of one readable block of namespace ``digest`` (its dtype and shape)."""
    mine = [k for k in keys if k.startswith(digest) and is_block_key(k)][:tries]
    for value in backend.get_many(mine):
        if value is None:
            continue
        try:
            return BlockCodec.read_header(value)
        except CorruptBlock:
            continue
    return None


def resolve_namespace(spec: str | None, found: Namespaces, digests: Sequence[bytes]) -> bytes:
    """The digest that ``spec`` names: a digest hex prefix, a model id, a JSON file of namespace
    fields, or nothing when the tier holds exactly one namespace."""
    if spec and Path(spec).is_file():
        try:
            data = json.loads(Path(spec).read_text())
            ns = Namespace.from_dict(data)
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"namespace file {spec}: {exc}") from None
        found.known.setdefault(ns.digest(), ns)
        return ns.digest()
    pool = sorted(set(digests) | set(found.known))
    if not spec:
        if len(pool) == 1:
            return pool[0]
        raise ConfigError(f"the store holds {len(pool)} namespaces: choose one with --namespace "
                          "(a digest prefix, a model id or a JSON file of namespace fields)")
    spec_l = spec.lower()  # a digest prefix and a model id alike (a model id of hex digits that
    # began another namespace's digest chose that namespace: evict removed the other model's blocks)
    hits = list(dict.fromkeys([d for d in pool if d.hex().startswith(spec_l)] +
                              [d for d in pool if d in found.known and found.known[d].model_id == spec]))
    if len(hits) == 1:
        return hits[0]
    if not hits:
        raise ConfigError(f"no namespace matches {spec!r} in this store")
    raise ConfigError(f"{spec!r} matches {len(hits)} namespaces (by digest prefix or model id); "
                      "give more digest characters")


def block_digests(keys: Iterable[bytes]) -> list[bytes]:
    """The namespaces (digests) that the block keys among ``keys`` belong to, sorted."""
    return sorted({split_key(k)[0] for k in keys if is_block_key(k)})


def namespace_filter(tier: Tier, spec: str | None) -> bytes | None:
    """The digest a command's ``--namespace`` names in ``tier`` (None: no option given)."""
    if spec is None:
        return None
    return resolve_namespace(spec, namespaces(tier.backend), block_digests(tier.backend.scan()))
