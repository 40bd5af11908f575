"""Option values and paths from backend URLs (``?sync=true&max_readers=64``, ``lmdb:///dir``)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from storage_backends.redaction import redact_url
from tiered_kv.errors import ConfigError
from tiered_kv.units import as_int as _as_int


def split_options(url: str) -> tuple[str, dict[str, str]]:
    """(url without the query, query parameters)."""
    parts = urlsplit(url)
    base = parts._replace(query="").geturl()
    return base, dict(parse_qsl(parts.query, keep_blank_values=True))


def with_options(url: str, options) -> str:
    """``url`` with the settings of an ``options`` table added to its query (those the query
    names already are left as it says them), as a medium reads them from a URL."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    added = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in options.items() if k not in query}
    if not added:
        return url
    return parts._replace(query=urlencode({**query, **added})).geturl()


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


def existing_directory(path: Path) -> Path:
    """``path`` when it is a directory; ConfigError saying what it is otherwise (the first part
    of "is there a store here?", the same words for every medium)."""
    if not path.exists():
        raise ConfigError(f"no store at {path}: the path does not exist")
    if not path.is_dir():
        raise ConfigError(f"{path} is a file, not a store directory")
    return path
