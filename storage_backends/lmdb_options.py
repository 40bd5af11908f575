"""The options an ``lmdb://`` URL may carry, and a URL's query read against them."""

from __future__ import annotations

from pathlib import Path

from storage_backends.options import known_options
from tiered_kv.errors import ConfigError

OPTIONS = ("capacity", "sync", "map_size", "readahead", "writemap", "max_readers", "batch_bytes",
           "record_access", "tenant_quota", "tenant_quotas", "segment_min", "segment_bytes", "writeback",
           "eager_writeback", "direct_io")


def url_options(url: str, options: dict) -> dict:
    """The URL's query with ``options`` over it (None: not given); unknown names refused."""
    return known_options("lmdb", url, options, OPTIONS)


def check_options(url: str, options: dict) -> None:
    """The options of an ``lmdb:`` tier checked as its config is built (names only)."""
    url_options(url, options)


def store_directory(path: Path) -> None:
    """Make the store's directory where it is missing; ConfigError where ``path`` is no directory
    or cannot be made (a missing or read-only parent raised OSError into an engine's scheduler)."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"lmdb path {path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"lmdb path {path} cannot be made: {exc.strerror or exc}") from None
