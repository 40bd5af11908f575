"""Backends by URL scheme or name, imported only when first used.

``open_backend("lmdb:///var/cache/tkv?capacity=8GiB")``, ``open_backend("redis://h:6379/0")``,
``open_backend("host://?capacity=1GiB&slot=2MiB")``, ``open_backend("file:///mnt/shared/tkv")``.
Query parameters become keyword arguments of the backend's ``from_url`` (strings; the backend
converts them). For tools: ``url_for_path(dir)`` asks every medium whether ``dir`` holds one of
its stores, and ``open_read_only(url, options=...)`` opens an existing store without changing it.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from storage_backends.options import existing_directory, split_options
from storage_backends.redaction import redact_url
from tiered_kv.errors import ConfigError, UnknownBackend

__all__ = ["backend_class", "is_url", "open_backend", "open_read_only", "register_backend",
           "registered_schemes", "scheme_of", "split_options", "url_for_path"]

log = logging.getLogger(__name__)

# scheme -> "module:Class"; a class provides from_url(url, **options). Media that keep stores in
# directories are asked in this order by url_for_path.
_REGISTRY: dict[str, str] = {
    "host": "storage_backends.host:HostBackend",
    "lmdb": "storage_backends.lmdb_disk:LmdbBackend",
    "file": "storage_backends.file_dir:FileBackend",
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
    """The registered scheme of ``url`` (or of a bare scheme name); ConfigError (UnknownBackend)
    for another one, and for a URL that cannot be parsed (an unclosed ``[`` of an IPv6 host)."""
    try:
        scheme = urlsplit(url).scheme.lower() if ":" in url else url.lower()
    except ValueError as exc:
        raise ConfigError(f"bad URL {redact_url(url)!r}: {exc}") from None
    if scheme not in _REGISTRY:
        raise UnknownBackend(f"no storage backend for {redact_url(url)!r}; known schemes: {registered_schemes()}")
    return scheme


def is_url(arg: str) -> bool:
    """Whether ``arg`` is a URL rather than a path (a one-letter scheme is a Windows drive); one
    that cannot be parsed still is (its opening says what is wrong with it)."""
    return re.match(r"[A-Za-z][A-Za-z0-9+.-]+:", arg) is not None


def backend_class(url: str) -> type:
    return _load(_REGISTRY[scheme_of(url)])


def _load(target: str) -> type:
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def open_backend(url: str, **options: Any):
    """Open the backend for ``url``; keyword options override query parameters."""
    cls = backend_class(url)
    return cls.from_url(url, **options)


def url_for_path(path: str | os.PathLike) -> str:
    """The URL of the store in directory ``path``, as the medium that recognises it writes it.
    Media are imported here, on first use; one whose import fails is skipped. ConfigError: no
    store at PATH (nothing there), PATH is a file, PATH is not a tiered-kv store."""
    where = existing_directory(Path(path).expanduser())
    signs = []
    for cls in _media():
        url = cls.store_url_at(where)
        if url is not None:
            return url
        if cls.store_signature:
            signs.append(cls.store_signature)
    raise ConfigError(f"{path} is not a tiered-kv store (no {', no '.join(signs) or 'medium knows it'})")


def _media() -> list[type]:
    """Every registered medium class that imports, once each, in registry order."""
    classes: list[type] = []
    for target in dict.fromkeys(_REGISTRY.values()):
        try:
            cls = _load(target)
        except ImportError as exc:
            log.debug("storage medium %s not available: %s", target, exc)
            continue
        if cls not in classes:
            classes.append(cls)
    return classes


def open_read_only(url: str, *, options: Mapping[str, Any] | None = None, timeout: float = 5.0):
    """Open the existing store at ``url`` (or at a store directory's path) for tools: nothing
    is created, tools' reads are not recorded as accesses, remote media answer within
    ``timeout`` seconds without retries. ``options``: the settings the engine opens the medium
    with (``TierConfig.medium_options``), over the URL's query, read by the medium itself as
    :func:`open_backend`'s keywords are (a config's quotas, sync or ttl reach a tool's writes).
    ConfigError when there is no store there (and for ``host://``, which lives inside a serving
    process)."""
    if not is_url(str(url)):
        url = url_for_path(url)
    return backend_class(url).open_read_only(url, options=dict(options or {}), timeout=timeout)
