"""Opening a store for tools: a URL, a store directory or a config file's lower tiers, as the
medium opens a store for tools (``storage_backends.registry.open_read_only``: nothing created,
tools' reads not recorded as accesses, a remote medium answering within the tool's timeout); a
config's tier with the settings its engine's store opens the medium with, which the medium reads.
The copy command's destination is opened the same way, or created when it names a new (or
empty) directory."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage_backends.base import Backend
from storage_backends.options import directory_of
from storage_backends.quotas import Quotas
from storage_backends.redaction import redact_url
from storage_backends.registry import backend_class, is_url, open_read_only, scheme_of
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import ConfigError
from tiered_kv.settings.loading import read_toml
from tiered_kv.store.records import namespace_key


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


def open_tier(url: str, *, name: str = "store", timeout: float = 5.0, options: Mapping[str, Any] | None = None) -> Tier:
    """The existing store at ``url`` (a URL or a store directory) for tools, its medium given
    ``options`` (a config's tier: ``TierConfig.medium_options``). A path that holds no store is
    an error, never a new empty store; a Redis that cannot be reached raises BackendUnavailable here."""
    return _reachable(name, open_read_only(url, options=options, timeout=timeout))


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
    return _reachable(name, backend)


def _new_directory(url: str) -> bool:
    """Whether ``url`` is of a medium that keeps its stores in directories and names one that
    does not exist yet or is empty (where opening it creates a store)."""
    if not getattr(backend_class(url), "store_signature", ""):
        return False
    path = directory_of(url, scheme_of(url))
    return not path.exists() or (path.is_dir() and not any(path.iterdir()))


def _reachable(name: str, backend: Backend) -> Tier:
    """``backend`` as a tier, once it answered a first call (Redis connects here); its capacity
    as the medium read it (a tool's lmdb open evicts to none, but was told one)."""
    told = backend.told_capacity
    tier = Tier(name, backend, told if told is not None else getattr(backend, "capacity", None))
    try:
        backend.contains_many([namespace_key(bytes(16))])
    except BaseException:
        tier.close()
        raise
    return tier


def _without_secret(path: str) -> TieredKVConfig:
    """The config at ``path`` with its ``encryption_secret`` left unread: these tools check
    sealed blocks without the key, and a ``file:`` only the engine's user may read (or an
    ``env:`` variable set only in the engine's environment) made them refuse the whole config.
    (``explain`` reads the secret itself: it opens blocks as the config's engine does.)"""
    data = read_toml(path)
    data.pop("encryption_secret", None)
    return TieredKVConfig.from_dict(data)


def open_config(path: str, *, timeout: float = 5.0, only: str | None = None) -> list[Tier]:
    """The lower tiers a TOML config file names, in the store's order (disk, remote, then its
    ``[[tiers]]``), or only the one named ``only`` (the host tier lives in a process)."""
    config = _without_secret(path)
    wanted = [t for t in config.lower_tiers if only is None or t.name == only]
    if not wanted:
        raise ConfigError(f"config {path} names no tier {only!r}" if only else
                          f"config {path} names no lower tier (disk, remote or [[tiers]])")
    tiers: list[Tier] = []
    try:
        for section in wanted:
            tier = open_tier(section.url, name=section.name, timeout=timeout, options=section.medium_options())
            tier.tenant_quota, tier.quotas = section.tenant_quota, section.quotas()
            tiers.append(tier)
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers

