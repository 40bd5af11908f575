"""The options a ``file:`` URL may carry and their values, read once: by the file medium as it
opens and by a config as it is built (nothing opened, no directory made)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from storage_backends.options import CONFIG_CHECKED, known_options
from storage_backends.quotas import Quotas
from tiered_kv.errors import ConfigError
from tiered_kv.units import as_bool, parse_size

OPTIONS = ("capacity", "sync", "touch", "create", "tenant_quota", "tenant_quotas")
IGNORED = ("timeout", "retries")  # remote-tier settings with no meaning for a local path


@dataclass(frozen=True)
class FileSettings:
    """A file tier's options read (:func:`file_settings`)."""

    capacity: int | None  # None: the filesystem decides
    quotas: Quotas
    sync: bool
    touch: bool
    create: bool


def file_settings(capacity: int | str | None = None, *, sync: bool | str = False, touch: bool | str = True,
                  create: bool | str = True, tenant_quota: int | str | None = None,
                  tenant_quotas=None) -> FileSettings:
    """The options' values (bytes, strings from a URL) checked and read; ConfigError naming the
    option. The only reading of them: the medium's constructor and :func:`check_options` call it."""
    size = None if capacity in (None, "") else parse_size(capacity, name="file capacity")
    if size is not None and size <= 0:
        raise ConfigError(f"file capacity must be positive, got {capacity!r}")
    quotas = Quotas.from_options("file", tenant_quota, tenant_quotas)
    return FileSettings(size, quotas, as_bool(sync, "file sync"), as_bool(touch, "file touch"),
                        as_bool(create, "file create"))


def url_options(url: str, options: Mapping) -> dict:
    """The URL's query with ``options`` over it (None: not given), but :data:`IGNORED`; unknown
    names refused."""
    return known_options("file", url, options, OPTIONS, IGNORED)


def check_options(url: str, options: Mapping) -> None:
    """The options of a ``file:`` tier checked as its config is built, names and values (a
    ``sync = []`` was a config until the tier opened, in the engine's worker), as the medium
    reads them (:data:`~storage_backends.options.CONFIG_CHECKED`: the config's own)."""
    query = {k: v for k, v in url_options(url, options).items() if k not in CONFIG_CHECKED}
    file_settings(**query)
