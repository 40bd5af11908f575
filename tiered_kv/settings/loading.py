"""Building frozen config dataclasses from plain data: a dict (TOML tables, JSON), a TOML file
or ``TIERED_KV_*`` variables. Each value is checked against its field's type (and parsed by the
field's ``parse`` metadata: sizes, durations); unknown keys and wrong types raise ConfigError
naming the key."""

from __future__ import annotations

import os
import typing
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from tiered_kv.errors import ConfigError
from tiered_kv.units import as_bool

ENV_PREFIX = "TIERED_KV_"


def read_toml(path: str | os.PathLike) -> dict:
    """The table a TOML file holds; ConfigError when it is missing or not TOML."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as exc:
        raise ConfigError(f"config file {path}: {exc}") from None


def env_dict(environ: Mapping[str, str], sections: set[str]) -> dict:
    """The ``TIERED_KV_*`` variables as a nested dict (values stay strings): those of a known
    section (``TIERED_KV_DISK_URL``) under it, the others at the top."""
    out: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX):].lower()
        head, _, tail = rest.partition("_")
        if head in sections and tail:
            out.setdefault(head, {})[tail] = value
        else:
            out[rest] = value
    return out


def build(cls: type, data: dict, prefix: str):
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"unknown config key {prefix}{unknown[0]!s}; known: {sorted(known)}")
    kwargs = {}
    for name, value in data.items():
        f, key = known[name], prefix + name
        target = hints[name]
        if typing.get_origin(target) is tuple and is_dataclass(typing.get_args(target)[0]):
            kwargs[name] = _build_list(typing.get_args(target)[0], key, value)
        elif typing.get_origin(target) in (Mapping, dict):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{key} must be a table of settings, got {value!r}")
            kwargs[name] = dict(value)
        elif is_dataclass(target):
            if isinstance(value, target):
                kwargs[name] = value
                continue
            if not isinstance(value, Mapping):
                raise ConfigError(f"{key} must be a table of settings, got {value!r}")
            kwargs[name] = build(target, dict(value), key + ".")
        else:
            if f.metadata.get("blank") == "refused" and isinstance(value, str) and _blank(value):
                # (an unset shell variable expands to ""; a secret that means "off" fails open)
                raise ConfigError(f"{key} is empty: leave it out to store plain blocks")
            kwargs[name] = _coerce(key, value, target, f.metadata.get("parse"))
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{prefix or 'config'}: {exc}") from None


def _build_list(item: type, key: str, value: Any) -> tuple:
    """A TOML array of tables (``[[tiers]]``) as a tuple of ``item`` dataclasses."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key} must be a list of tables, got {value!r}")
    out = []
    for i, entry in enumerate(value):
        if isinstance(entry, item):
            out.append(entry)
        elif isinstance(entry, Mapping):
            out.append(build(item, dict(entry), f"{key}[{i}]."))
        else:
            raise ConfigError(f"{key}[{i}] must be a table of settings, got {entry!r}")
    return tuple(out)


def _coerce(key: str, value: Any, target: Any, parse) -> Any:
    args = typing.get_args(target)
    optional = type(None) in args
    if value is None or (optional and isinstance(value, str) and _blank(value)):
        if optional:
            return None
        raise ConfigError(f"{key} must not be empty")
    if parse is not None:
        return parse(value, name=key)
    base = next((a for a in args if a is not type(None)), target) if args else target
    if base is bool:
        return as_bool(value, key)
    if base is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        try:
            return int(value) if isinstance(value, str) else _exact_int(key, value)
        except ValueError:
            raise ConfigError(f"{key} must be an integer, got {value!r}") from None
    if base is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be a number, got {value!r}") from None
    if base is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    return value


def _blank(text: str) -> bool:
    """Whether a setting's text means "not set" (``""``, ``none``, ``null``)."""
    return text.strip().lower() in ("", "none", "null")


def _exact_int(key: str, value: Any) -> int:
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ConfigError(f"{key} must be an integer, got {value!r}")


