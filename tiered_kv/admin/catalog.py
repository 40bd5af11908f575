"""What a store holds, for tools: open a store by URL, path or config file without creating or
changing it, and list its entries (blocks, namespace records, foreign keys) with their figures.

Reads made here leave LRU order alone where the medium allows it: the LMDB meta table gives
sizes, times and hits without reading blocks, and tools' own reads are not recorded as accesses.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from storage_backends.base import Backend
from storage_backends.redaction import redact_url
from storage_backends.registry import open_backend, scheme_of, split_options
from tiered_kv.store.codec import MAX_RAW_BYTES, BlockCodec, BlockHeader, BlockLayout, itemsize
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import ConfigError, CorruptBlock
from tiered_kv.keys import Namespace
from tiered_kv.store.records import (
    NAMESPACE_PREFIX,
    decode_namespace,
    is_block_key,
    is_namespace_key,
    namespace_key,
    split_key,
)
from tiered_kv.units import parse_size

log = logging.getLogger(__name__)

REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster")
FILE_MARKER = ".tiered-kv-file-store"  # storage_backends.file_layout.MARKER
READ_BATCH = 64  # values read per call when headers are needed


@dataclass
class Tier:
    """One opened medium of a store: a bare URL ("store") or a config's disk / remote tier."""

    name: str
    url: str
    backend: Backend
    capacity: int | None = None  # the configured byte capacity, when one was given

    def __post_init__(self) -> None:
        self.url = redact_url(self.url)  # what tools show; the backend holds what it needs

    @property
    def shown_url(self) -> str:
        """The medium's URL without credentials, for tables, JSON and logs."""
        return redact_url(self.backend.url)

    def close(self) -> None:
        self.backend.close()


@dataclass
class Entry:
    """One stored value as tools see it."""

    key: bytes
    kind: str  # "block" | "namespace" (a namespace record) | "foreign"
    size: int | None = None  # stored bytes
    created: float | None = None  # seconds since the epoch
    last_access: float | None = None  # seconds since the epoch (None: the medium does not say)
    hits: int | None = None
    header: BlockHeader | None = None  # when the value was read
    error: str | None = None  # why the header could not be read

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


# -- opening --------------------------------------------------------------------------------------
def store_url(arg: str) -> str:
    """A store URL from a command-line argument: a URL as it is, or a path to an LMDB store
    directory or a file store directory."""
    if _has_scheme(arg):
        scheme_of(arg)  # UnknownBackend for schemes nobody registered
        return arg
    path = Path(arg).expanduser()
    if not path.exists():
        raise ConfigError(f"no store at {arg}: the path does not exist")
    if not path.is_dir():
        raise ConfigError(f"{arg} is a file, not a store (an LMDB directory or a file:// store directory)")
    if (path / "data.mdb").is_file():
        return f"lmdb://{path.resolve()}"
    if (path / FILE_MARKER).is_file():
        return f"file://{path.resolve()}"
    raise ConfigError(f"{arg} is not a tiered-kv store (no LMDB data.mdb, no file-store marker)")


def _has_scheme(arg: str) -> bool:
    return ":" in arg and len(urlsplit(arg).scheme) > 1  # (one letter: a Windows drive)


def open_tier(url: str, *, name: str = "store", create: bool = False, timeout: float = 5.0,
              capacity: int | None = None) -> Tier:
    """Open ``url`` for tools. Without ``create`` a path that holds no store is an error, never
    a new empty store; a Redis that cannot be reached raises BackendUnavailable here."""
    if create and not _has_scheme(url) and not Path(url).expanduser().exists():
        raise ConfigError(f"no store at {url}: name a new one as lmdb://{url} or file://{url}")
    url = store_url(url)
    scheme = scheme_of(url)
    options: dict = {}
    if scheme == "host":
        raise ConfigError("host:// lives inside a serving process; point tools at the disk or "
                          "remote tier (or use `tiered-kv stats` on its metrics port)")
    if scheme == "lmdb":
        from storage_backends.lmdb_disk import path_of

        path = path_of(url)
        if not create:
            store_url(str(path))  # the same one-line errors as for a bare path
    elif scheme == "file":
        options = {"touch": "false", "create": "true" if create else "false"}
    elif scheme in REDIS_SCHEMES:
        options = {"timeout": timeout, "retries": 0}
    _, query = split_options(url)
    if capacity is None and "capacity" in query:
        capacity = parse_size(query["capacity"], name="capacity")
    backend = open_backend(url, **options)
    _quiet(backend)
    tier = Tier(name, url, backend, capacity)
    try:
        backend.contains_many([namespace_key(bytes(16))])  # reachable at all? (Redis connects here)
    except BaseException:
        tier.close()
        raise
    return tier


def open_config(path: str, *, timeout: float = 5.0, only: str | None = None) -> list[Tier]:
    """The disk and remote tiers a TOML config file names (the host tier lives in a process)."""
    config = TieredKVConfig.from_toml(path)
    wanted = [(n, s) for n, s in (("disk", config.disk), ("remote", config.remote))
              if s.url and (only is None or n == only)]
    if not wanted:
        raise ConfigError(f"config {path} names no {only or 'disk or remote'} tier")
    tiers: list[Tier] = []
    try:
        for name, section in wanted:
            capacity = getattr(section, "capacity", None)
            tiers.append(open_tier(section.url, name=name, timeout=timeout, capacity=capacity))
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers


def _quiet(backend: Backend) -> None:
    """Tools' reads must not count as accesses: a verify or a copy would otherwise make every
    block look just used. The file medium has an option for it (set above); LMDB buffers
    accesses in ``_touch`` — this instance, owned by the tool, drops them."""
    if getattr(backend, "name", "") == "lmdb" and hasattr(backend, "_touch"):
        backend._touch = lambda keys, now: None  # type: ignore[method-assign]


# -- listing --------------------------------------------------------------------------------------
def kind_of(key: bytes) -> str:
    if is_block_key(key):
        return "block"
    return "namespace" if is_namespace_key(key) else "foreign"


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


def entries(backend: Backend, *, headers: bool = False, keys: Sequence[bytes] | None = None) -> Iterator[Entry]:
    """Every entry (or those of ``keys``), with size and times from the medium's meta data where
    it keeps some (LMDB, file) and from block headers otherwise (Redis) or with ``headers``."""
    keys = sorted(backend.scan()) if keys is None else list(keys)
    meta_of = getattr(backend, "entry_meta", None)
    for start in range(0, len(keys), READ_BATCH):
        batch = keys[start : start + READ_BATCH]
        metas = [meta_of(k) for k in batch] if meta_of is not None else [None] * len(batch)
        read = headers or meta_of is None
        values = backend.get_many(batch) if read else [None] * len(batch)
        for key, meta, value in zip(batch, metas, values):
            if read and value is None or (not read and meta is None):
                continue  # deleted since the scan
            entry = Entry(key, kind_of(key))
            if meta is not None:
                entry.size, entry.hits = meta["size"], meta["hits"]
                entry.created = meta["created_ns"] / 1e9
                entry.last_access = meta["last_access_ns"] / 1e9
            if value is not None:
                entry.size = len(value)
                if entry.kind == "block":
                    _read_header(entry, value)
            yield entry


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


def raw_block_bytes(namespace: Namespace) -> int:
    """Payload bytes of one block of ``namespace`` (canonical layout, engine dtype)."""
    n = itemsize(namespace.dtype) * 2 * namespace.block_size
    return n * namespace.num_layers * namespace.num_kv_heads * namespace.head_dim


def block_shape(namespace: Namespace) -> list[int]:
    return [namespace.num_layers, 2, namespace.block_size, namespace.num_kv_heads, namespace.head_dim]


def block_layout(namespace: Namespace | None) -> BlockLayout | None:
    """The block every stored block of ``namespace`` must be (None: namespace unknown)."""
    return None if namespace is None else BlockLayout(namespace.dtype, tuple(block_shape(namespace)))


def check_block(key: bytes, value, namespace: Namespace | None, *, decode: bool = True):
    """Validate a stored block as the store would: against its namespace's block (dtype, shape)
    when the namespace is known, else with its declared raw length bounded (MAX_RAW_BYTES), so a
    lying header never makes a tool allocate what it declares. (header, payload) with
    ``decode``, the header alone without; CorruptBlock (one-line detail) when it fails."""
    digest, block = split_key(key)
    layout = block_layout(namespace)
    if decode:
        return BlockCodec().decode(value, namespace=digest, key=block, expect=layout)
    return BlockCodec.read_header(value, namespace=digest, key=block, expect=layout, max_raw=MAX_RAW_BYTES)


def resolve_namespace(spec: str | None, found: Namespaces, digests: Sequence[bytes]) -> bytes:
    """The digest that ``spec`` names: a digest hex prefix, a model id, a JSON file of namespace
    fields, or nothing when the tier holds exactly one namespace."""
    if spec and Path(spec).is_file():
        try:
            data = json.loads(Path(spec).read_text())
            ns = Namespace(**data)
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
    spec_l = spec.lower()
    hits = [d for d in pool if d.hex().startswith(spec_l)] or \
        [d for d in pool if d in found.known and found.known[d].model_id == spec]
    if len(hits) == 1:
        return hits[0]
    if not hits:
        raise ConfigError(f"no namespace matches {spec!r} in this store")
    raise ConfigError(f"{spec!r} matches {len(hits)} namespaces; give more digest characters")
