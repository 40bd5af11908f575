"""The options an ``lmdb://`` URL may carry, and a URL's query read against them."""

from __future__ import annotations

from storage_backends.options import split_options
from tiered_kv.errors import ConfigError

OPTIONS = ("capacity", "sync", "map_size", "readahead", "writemap", "max_readers", "batch_bytes",
           "record_access", "tenant_quota", "tenant_quotas", "segment_min", "segment_bytes", "writeback",
           "eager_writeback", "direct_io")


def url_options(url: str, options: dict) -> dict:
    """The URL's query with ``options`` over it (None: not given); unknown names refused."""
    _, query = split_options(url)
    query.update({k: v for k, v in options.items() if v is not None})
    unknown = sorted(set(query) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"unknown lmdb option {unknown[0]!r} (known: {', '.join(OPTIONS)})")
    return query
