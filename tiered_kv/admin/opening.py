"""Opening a store for tools: a URL, a store directory or a config file's lower tiers, read-only
(nothing is created, and tools' reads are not recorded as accesses: a verify or a copy must not
make every block look just used). The copy command's destination is the one store opened to be
written, and created when it is a new path."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from storage_backends.base import Backend
from storage_backends.redaction import redact_url
from storage_backends.registry import open_backend, scheme_of, split_options
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import ConfigError
from tiered_kv.store.records import namespace_key
from tiered_kv.units import parse_size

REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster")
FILE_MARKER = ".tiered-kv-file-store"  # storage_backends.file_layout.MARKER


@dataclass
class Tier:
    """One opened medium of a store: a bare URL ("store") or one of a config's lower tiers."""

    name: str
    backend: Backend
    capacity: int | None = None  # the configured byte capacity, when one was given
    tenant_quota: int | None = None  # the configured bytes per tenant, when one was given

    @property
    def shown_url(self) -> str:
        """The medium's URL without credentials, for tables, JSON and logs."""
        return redact_url(self.backend.url)

    def close(self) -> None:
        self.backend.close()


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
    tier = Tier(name, backend, capacity)
    try:
        backend.contains_many([namespace_key(bytes(16))])  # reachable at all? (Redis connects here)
    except BaseException:
        tier.close()
        raise
    return tier


def open_config(path: str, *, timeout: float = 5.0, only: str | None = None) -> list[Tier]:
    """The lower tiers a TOML config file names, in the store's order (disk, remote, then its
    ``[[tiers]]``), or only the one named ``only`` (the host tier lives in a process)."""
    config = TieredKVConfig.from_toml(path)
    wanted = [t for t in config.lower_tiers if only is None or t.name == only]
    if not wanted:
        raise ConfigError(f"config {path} names no tier {only!r}" if only else
                          f"config {path} names no lower tier (disk, remote or [[tiers]])")
    tiers: list[Tier] = []
    try:
        for section in wanted:
            tier = open_tier(section.url, name=section.name, timeout=timeout, capacity=section.capacity)
            tier.tenant_quota = section.tenant_quota
            tiers.append(tier)
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers


def _quiet(backend: Backend) -> None:
    """Tools' reads must not count as accesses. The file medium has an option for it (set
    above); LMDB buffers accesses in ``_touch`` — this instance, owned by the tool, drops them."""
    if getattr(backend, "name", "") == "lmdb" and hasattr(backend, "_touch"):
        backend._touch = lambda keys, now: None  # type: ignore[method-assign]
