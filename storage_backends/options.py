"""Option values and paths from backend URLs (``?sync=true&max_readers=64``, ``lmdb:///dir``)."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Collection, Mapping
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

from storage_backends.redaction import redact_url
from tiered_kv.errors import ConfigError
from tiered_kv.units import as_int as _as_int

log = logging.getLogger(__name__)


def split_options(url: str) -> tuple[str, dict[str, str]]:
    """(url without the query, query parameters). ConfigError for a parameter given twice with
    different values (``?sync=true&sync=false`` was read as its last: a setting is written once;
    the values are not quoted, one may be a password)."""
    parts = urlsplit(url)
    base = parts._replace(query="").geturl()
    query: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if query.setdefault(name, value) != value:
            raise ConfigError(f"the URL {redact_url(url)!r} sets {name!r} twice, to different values")
    return base, query


def as_int(value, name: str, minimum: int = 1) -> int:
    """``value`` as an integer of at least ``minimum`` (:func:`tiered_kv.units.as_int`)."""
    return _as_int(value, name, minimum=minimum)


def directory_of(url: str, scheme: str) -> Path:
    """The directory a ``scheme:`` URL names: ``scheme:///abs/dir`` -> /abs/dir;
    ``scheme://./rel`` and ``scheme:rel`` -> rel; ``~`` expands; percent-escapes decode."""
    base, _ = split_options(url)
    prefix = f"{scheme}:"
    if not base.lower().startswith(prefix):
        raise ConfigError(f"not a {scheme} URL: {redact_url(url)!r}")
    rest = base[len(prefix):]
    rest = rest[2:] if rest.startswith("//") else rest
    if not rest:
        raise ConfigError(f"{scheme} URL {redact_url(url)!r} names no directory")
    return Path(unquote(rest)).expanduser()


def three_slash_form(url: str, scheme: str) -> str | None:
    """``scheme:///var/cache/tkv`` for ``url`` = ``scheme://var/cache/tkv`` (two slashes, then a
    name: a reader takes "var" for the URL's host, :func:`directory_of` the relative directory
    ./var/cache/tkv, as documented), the absolute form its writer may have meant; None for every
    other form (``scheme:///abs``, ``scheme://./rel``, ``scheme://~/dir``, ``scheme:rel``)."""
    base, _ = split_options(url)
    rest = base[len(scheme) + 1:] if base.lower().startswith(f"{scheme}:") else ""
    if not rest.startswith("//") or unquote(rest[2:])[:1] in ("", "/", ".", "~"):  # (%2F: a slash)
        return None
    return f"{scheme}:///{rest[2:]}"


def warn_if_relative(url: str | None, scheme: str, path: Path) -> None:
    """One warning when ``url`` is the two-slash form (:func:`three_slash_form`) naming ``path``."""
    if url is not None and (absolute := three_slash_form(url, scheme)) is not None:
        log.warning("%s tier %s names the directory %s, relative to the working directory (after two "
                    "slashes a name is no host); the absolute directory is %s (three slashes)",
                    scheme, redact_url(url), path.resolve(), redact_url(absolute))


def existing_directory(path: Path) -> Path:
    """``path`` when it is a directory; ConfigError saying what it is otherwise (the first part
    of "is there a store here?", the same words for every medium)."""
    if not path.exists():
        raise ConfigError(f"no store at {path}: the path does not exist")
    if not path.is_dir():
        raise ConfigError(f"{path} is a file, not a store directory")
    return path


# scheme -> "module:function(url, options)" raising ConfigError for options (the URL's query and
# an options table) that medium would refuse as it opens: checked when a config is built, with
# no medium opened or imported (a medium registered with no check here is checked as it opens)
OPTION_CHECKS = {"lmdb": "storage_backends.lmdb_options:check_options",
                 "file": "storage_backends.file_options:check_options",
                 **dict.fromkeys(("redis", "rediss", "unix", "redis+cluster"),
                                 "storage_backends.redis_options:check_options")}


# settings a tier's config reads itself (its fields, the quotas table) and refuses in its own words
# ("disk.capacity must be positive"): a medium's check_options leaves them to it
CONFIG_CHECKED = ("capacity", "tenant_quota", "tenant_quotas")


def check_url_options(url: str, options: Mapping) -> None:
    """ConfigError for an option of ``url``'s medium it does not know (in the URL's query or
    ``options``; None values are no setting): ``lmdb:///x?no_such=1`` was a config until the
    tier opened, in the engine's worker."""
    try:
        scheme = urlsplit(url).scheme.lower()
    except ValueError:  # (the registry says what is wrong with the URL)
        return
    target = OPTION_CHECKS.get(scheme)
    if target is not None:
        module, _, name = target.partition(":")
        getattr(importlib.import_module(module), name)(url, dict(options))


def known_options(medium: str, url: str, options: Mapping, known: Collection[str],
                  ignored: Collection[str] = ()) -> dict:
    """The URL's query with ``options`` over it (None: not given), but ``ignored``; ConfigError
    naming the first option not ``known``."""
    _, query = split_options(url)
    query.update({k: v for k, v in options.items() if v is not None})
    for name in ignored:
        query.pop(name, None)
    unknown = sorted(set(query) - set(known))
    if unknown:
        raise ConfigError(f"unknown {medium} option {unknown[0]!r} (known: {', '.join(known)})")
    return query

