"""Opening a store for tools: a URL, a store directory or a config file's lower tiers, as the
medium opens a store for tools (``storage_backends.registry.open_read_only``: nothing created,
tools' reads not recorded as accesses, a remote medium answering within the tool's timeout).
The copy command's destination is opened the same way, or created when it names a new (or
empty) directory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from storage_backends.base import Backend
from storage_backends.options import directory_of, with_options
from storage_backends.quotas import Quotas
from storage_backends.redaction import redact_url
from storage_backends.registry import (
    backend_class,
    is_url,
    open_read_only,
    scheme_of,
    split_options,
)
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import ConfigError
from tiered_kv.settings.tiers import TierConfig
from tiered_kv.store.records import namespace_key
from tiered_kv.units import parse_size


@dataclass
class Tier:
    """One opened medium of a store: a bare URL ("store") or one of a config's lower tiers."""

    name: str
    backend: Backend
    capacity: int | None = None  # the configured byte capacity, when one was given
    tenant_quota: int | None = None  # the configured bytes per tenant, when one was given
    quotas: Quotas | None = None  # a config's tenant quotas as its engine's medium reads them (None: the medium's)

    @property
    def shown_url(self) -> str:
        """The medium's URL without credentials, for tables, JSON and logs."""
        return redact_url(self.backend.url)

    def close(self) -> None:
        self.backend.close()


def open_tier(url: str, *, name: str = "store", timeout: float = 5.0, capacity: int | None = None) -> Tier:
    """The existing store at ``url`` (a URL or a store directory) for tools. A path that holds no
    store is an error, never a new empty store; a Redis that cannot be reached raises
    BackendUnavailable here."""
    return _reachable(name, open_read_only(url, timeout=timeout), url, capacity)


def open_destination(url: str, *, name: str = "destination", timeout: float = 5.0,
                     room: Callable[[], int] = lambda: 0) -> Tier:
    """The store at ``url`` to copy into: an existing one opened as :func:`open_tier` does, or a
    new one when ``url`` names a directory that does not exist yet (or is empty), made to take
    ``room()`` bytes (asked only then) with no capacity but the URL's (``create_for_tool``)."""
    if not is_url(url):
        if not Path(url).expanduser().exists():
            raise ConfigError(f"no store at {url}: name a new one as lmdb://{url} or file://{url}")
        return open_tier(url, name=name, timeout=timeout)
    try:
        backend = open_read_only(url, timeout=timeout)
    except ConfigError:
        if not _new_directory(url):
            raise
        backend = backend_class(url).create_for_tool(url, room=room())
    return _reachable(name, backend, url, None)


def _new_directory(url: str) -> bool:
    """Whether ``url`` is of a medium that keeps its stores in directories and names one that
    does not exist yet or is empty (where opening it creates a store)."""
    if not getattr(backend_class(url), "store_signature", ""):
        return False
    path = directory_of(url, scheme_of(url))
    return not path.exists() or (path.is_dir() and not any(path.iterdir()))


def _reachable(name: str, backend: Backend, url: str, capacity: int | None) -> Tier:
    """``backend`` as a tier, once it answered a first call (Redis connects here); its capacity
    from the URL's ``capacity`` when none is given."""
    tier = Tier(name, backend, capacity)
    try:
        if capacity is None and is_url(url):
            tier.capacity = _url_capacity(url)
        backend.contains_many([namespace_key(bytes(16))])
    except BaseException:
        tier.close()
        raise
    return tier


def _url_capacity(url: str) -> int | None:
    """The URL's ``capacity`` read as its medium reads it, in its words (a tool's open of an
    lmdb store leaves it out: ``?capacity=0``, refused by the engine, was a tool's tier of no
    capacity, and a bad one was refused as "capacity", a name of no medium)."""
    _, query = split_options(url)
    if "capacity" not in query:
        return None
    medium = scheme_of(url)
    size = parse_size(query["capacity"], name=f"{medium} capacity")
    if size <= 0:
        raise ConfigError(f"{medium} capacity must be positive, got {query['capacity']!r}")
    return size


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
            tier = open_tier(tool_url(section), name=section.name, timeout=timeout, capacity=section.capacity)
            tier.tenant_quota, tier.quotas = section.tenant_quota, section.quotas()
            tiers.append(tier)
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers


def tool_url(section: TierConfig) -> str:
    """The URL a tool opens ``section``'s medium with: its options table in the query (a Redis
    prefix written there was read as the default one), each value spelled so the medium reads it
    from the query as the engine's reads the table (:func:`~storage_backends.options.with_options`).
    The config was built, so every value is one the engine takes. Left out: ``tenant_quotas``, a
    table no URL carries (the medium refuses it there: every tool refused a config the engine
    serves with); :attr:`Tier.quotas` has it."""
    return with_options(section.url, {k: v for k, v in section.options.items() if k != "tenant_quotas"})
