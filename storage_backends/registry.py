"""Backends by URL scheme or name, imported only when first used.

``open_backend("lmdb:///var/cache/tkv?capacity=8GiB")``, ``open_backend("redis://h:6379/0")``,
``open_backend("host://?capacity=1GiB&slot=2MiB")``, ``open_backend("file:///mnt/shared/tkv")``. Query parameters become keyword arguments
of the backend's ``from_url`` (strings; the backend converts them).
"""

from __future__ import annotations

import importlib
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from storage_backends.redaction import redact_url
from tiered_kv.errors import UnknownBackend

# scheme -> "module:Class"; a class provides from_url(url, **options)
_REGISTRY: dict[str, str] = {
    "host": "storage_backends.host:HostBackend",
    "file": "storage_backends.file_dir:FileBackend",
    "lmdb": "storage_backends.lmdb_disk:LmdbBackend",
    "redis": "storage_backends.redis_remote:RedisBackend",
    "rediss": "storage_backends.redis_remote:RedisBackend",
    "unix": "storage_backends.redis_remote:RedisBackend",
    "redis+cluster": "storage_backends.redis_remote:RedisBackend",
}


def register_backend(scheme: str, target: str) -> None:
    """Register ``target`` ("module:Class") for URLs of ``scheme``."""
    if ":" not in target:
        raise ValueError("target must look like 'package.module:ClassName'")
    _REGISTRY[scheme.lower()] = target


def registered_schemes() -> list[str]:
    return sorted(_REGISTRY)


def scheme_of(url: str) -> str:
    scheme = urlsplit(url).scheme.lower() if ":" in url else url.lower()
    if scheme not in _REGISTRY:
        raise UnknownBackend(f"no storage backend for {redact_url(url)!r}; known schemes: {registered_schemes()}")
    return scheme


def backend_class(url: str) -> type:
    module_name, _, class_name = _REGISTRY[scheme_of(url)].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def split_options(url: str) -> tuple[str, dict[str, str]]:
    """(url without the query, query parameters)."""
    parts = urlsplit(url)
    base = parts._replace(query="").geturl()
    return base, dict(parse_qsl(parts.query, keep_blank_values=True))


def open_backend(url: str, **options: Any):
    """Open the backend for ``url``; keyword options override query parameters."""
    cls = backend_class(url)
    return cls.from_url(url, **options)
