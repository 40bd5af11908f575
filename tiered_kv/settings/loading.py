"""Building frozen config dataclasses from plain data: a dict (TOML tables, JSON), a TOML file
or ``TIERED_KV_*`` variables. Each value is checked against its field's type (and parsed by the
field's ``parse`` metadata: sizes, durations); unknown keys and wrong types raise ConfigError
naming the key."""

from __future__ import annotations

import functools
import os
import typing
from collections.abc import Mapping
from dataclasses import MISSING, fields, is_dataclass
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from storage_backends.redaction import redact_text
from tiered_kv.errors import ConfigError
from tiered_kv.units import as_bool, as_int

ENV_PREFIX = "TIERED_KV_"
BYTE_ORDER_MARK = "\ufeff"  # what Windows editors write first in a UTF-8 file: no TOML, no setting
MAX_CONFIG_BYTES = 1 << 20  # a config file longer than this is refused (ours are a few KiB)


def read_toml(path: str | os.PathLike) -> dict:
    """The table a TOML file holds (``~`` expanded, as in store URLs: a path in an engine's JSON
    settings meets no shell; one leading UTF-8 byte-order mark dropped: tomllib refused such a
    file as invalid TOML at line 1); ConfigError when it is missing, not TOML, or longer than
    ``MAX_CONFIG_BYTES`` (read no further: ``/dev/zero`` or a stream that never ends named by
    mistake would otherwise be read until memory ran out)."""
    try:
        with open(os.path.expanduser(path), "rb") as fh:
            data = fh.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {path}: longer than {MAX_CONFIG_BYTES} bytes (is it a config file?)")
        return tomllib.loads(data.decode("utf-8").removeprefix(BYTE_ORDER_MARK))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as exc:
        raise ConfigError(f"config file {path}: {exc}") from None


def env_dict(environ: Mapping[str, str], sections: set[str]) -> dict:
    """The ``TIERED_KV_*`` variables as a nested dict (values stay strings): those of a known
    section (``TIERED_KV_DISK_URL``) under it, the others at the top."""
    out: dict[str, Any] = {}
    names: dict[str, str] = {}  # setting -> the variable that set it
    for name, value in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX):].lower()
        if rest in sections:  # (its value is not quoted: a URL there may hold a password)
            raise ConfigError(f"{name} names the section {rest}: set its fields ({name}_<FIELD>)")
        if rest in names and _setting(out, rest, sections) != value:  # (the case of a name is no setting)
            raise ConfigError(f"{names[rest]} and {name} set one setting to different values")
        names[rest] = name
        head, _, tail = rest.partition("_")
        if head in sections and tail:
            out.setdefault(head, {})[tail] = value
        else:
            out[rest] = value
    return out


def _setting(out: dict, rest: str, sections: set[str]) -> Any:
    head, _, tail = rest.partition("_")
    return out[head][tail] if head in sections and tail else out[rest]


def build_config(cls: type, data: dict):
    """:func:`build` of a whole config: an error quotes no credential of a URL in ``data`` (a URL
    written where a table or a number belongs is quoted in the error that says so)."""
    try:
        return build(cls, data, "")
    except ConfigError as exc:
        message = _without_secrets(str(exc), data)
        if message == str(exc):
            raise
        raise type(exc)(message) from None


def _without_secrets(text: str, value: Any) -> str:
    if isinstance(value, str):
        return redact_text(text, value) if "://" in value else text
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            text = _without_secrets(text, item)
    return text


def build(cls: type, data: dict, prefix: str):
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known), key=str)
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
            if (isinstance(value, str) and not value.strip() and type(None) in typing.get_args(target)
                    and f.default not in (None, MISSING)):
                # ("" is what ``TIERED_KV_CLOSE_TIMEOUT=$UNSET`` gives: it meant None, wait for
                # ever, not the default; "none" still says None where None is allowed)
                raise ConfigError(f"{key} is empty: leave it out for its default ({f.default!r})")
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
        return as_int(value, key)
    if base is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be a number, got {_shown(key, value)}") from None
    if base is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {_shown(key, value)}")
        return value
    return value


SECRET_SETTINGS = ("cache_salt",)  # settings whose value no message shows (encryption_secret: a Secret)


def _shown(key: str, value: Any) -> str:
    """``value`` as a message shows it: a secret setting's never (a cache_salt given as a list
    was printed in the error, on the CLI's stderr and in engine logs)."""
    return "a value not shown (a secret)" if key.rsplit(".", 1)[-1] in SECRET_SETTINGS else repr(value)


def _blank(text: str) -> bool:
    """Whether a setting's text means "not set" (``""``, ``none``, ``null``)."""
    return text.strip().lower() in ("", "none", "null")


_NOUNS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


@functools.cache
def _plain_fields(cls: type) -> tuple[tuple[str, type, bool], ...]:
    """(name, type, None allowed) of the fields of ``cls`` that hold an int, float, str or bool."""
    out = []
    for name, hint in typing.get_type_hints(cls).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        if name in {f.name for f in fields(cls)} and len(args) == 1 and args[0] in _NOUNS:
            out.append((name, args[0], type(None) in typing.get_args(hint)))
    return tuple(out)


def check_types(obj: Any, prefix: str) -> None:
    """ConfigError naming the first plain field of ``obj`` (a config made in code, not loaded)
    whose value is not of its type: a bool is no number, an int is a float."""
    for name, kind, optional in _plain_fields(type(obj)):
        value = getattr(obj, name)
        if value is None and optional:
            continue
        kinds = (int, float) if kind is float else kind
        if not isinstance(value, kinds) or (kind is not bool and isinstance(value, bool)):
            raise ConfigError(f"{prefix}{name} must be {_NOUNS[kind]}, got {_without_secrets(repr(value), value)}")
