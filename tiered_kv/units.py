"""Byte sizes and durations as people write them: "8GiB", "512MB", "1.5 GiB", "30s", "2h"; whole
numbers and true/false settings as configs, URLs and variables spell them."""

from __future__ import annotations

import math
import re
from decimal import Decimal

from tiered_kv.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?i?b?)?\s*$", re.IGNORECASE | re.ASCII)
_FACTORS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _FACTORS[_p] = _FACTORS[_p + "b"] = 1000**_i
    _FACTORS[_p + "i"] = _FACTORS[_p + "ib"] = 1024**_i

_INT = re.compile(r"\s*[+-]?\d+(?:_\d+)*\s*", re.ASCII)  # as TOML and int() spell them; no 0x, 1e3 or 2.0
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$", re.IGNORECASE | re.ASCII)
_SECONDS = {"ms": 0.001, "s": 1, "": 1, "m": 60, "h": 3600, "d": 86400}
MAX_SIZE = (1 << 63) - 1  # no file, map or buffer is larger (C APIs overflow past it)


def parse_size(value: int | float | str, *, name: str = "size") -> int:
    """Bytes from an int or a string like "8GiB" / "512MB" / "4096"; ConfigError otherwise."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a byte size, got {value!r}")
    m = _SIZE.match(value) if isinstance(value, str) else None
    if isinstance(value, int) or (isinstance(value, float) and math.isfinite(value)):
        number, factor = value, 1
    elif m and (m.group(2) or "").lower() in _FACTORS:
        number, factor = Decimal(m.group(1)), _FACTORS[(m.group(2) or "").lower()]  # exact
    else:
        raise ConfigError(f"{name}: expected a byte size like 8GiB or 512MB, got {value!r}")
    if number < 0:
        raise ConfigError(f"{name}: size must not be negative, got {_short(value)}")
    if factor == 1 and number != int(number):  # 1.5 bytes meant something else: never cut to 1
        raise ConfigError(f"{name}: a size in bytes is a whole number, got {value!r} (1.5GiB: write the unit)")
    if number * factor > MAX_SIZE:  # (and a size of thousands of digits has no repr)
        raise ConfigError(f"{name}: size must be at most 8 EiB, got {_short(value)}")
    return int(number * factor)


def _short(value: object) -> str:
    """``repr(value)``, but for an int too long to convert (never cut: a URL cut in its password
    could no longer be redacted by whoever quotes the message)."""
    return "a huge number" if isinstance(value, int) and value.bit_length() > 3000 else repr(value)


def parse_duration(value: int | float | str, *, name: str = "duration") -> float:
    """Seconds from a number or a string like "250ms" / "30s" / "2h"."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a duration, got {value!r}")
    seconds = math.nan
    if isinstance(value, (int, float)):
        seconds = float(value) if isinstance(value, float) or abs(value) < 2**1000 else math.inf
    elif isinstance(value, str) and (m := _DURATION.match(value)):
        seconds = float(m.group(1)) * _SECONDS[(m.group(2) or "").lower()]
    if not math.isfinite(seconds):  # also NaN / inf, which TOML allows
        raise ConfigError(f"{name}: expected a duration like 30s or 2h, got {_short(value)}")
    if seconds < 0:
        raise ConfigError(f"{name}: duration must not be negative, got {value!r}")
    return seconds


def format_size(n: int | float) -> str:
    """Human form of a byte count, e.g. "1.5 GiB"."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def as_bool(value: bool | int | str, name: str) -> bool:
    """A setting as a bool: a bool, 0 / 1, or a string such as "yes", "off", "True" (case and
    surrounding blanks ignored). A blank string is no setting and refused like any other word
    (``?sync=`` in a URL is a mistake, not "false"); ConfigError naming ``name``."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower() if isinstance(value, (int, str)) else None
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{name} must be true or false (1/0, yes/no, on/off), got {value!r}")


def as_int(value: int | float | str, name: str, *, minimum: int | None = None) -> int:
    """A setting as a whole number: an int, a float with no fraction (TOML's ``2.0``) or ASCII
    digits with an optional sign, ``_`` between digits and surrounding blanks (``" 64 "``,
    ``"1_000"``); never a bool, ``"1e3"``, ``"0x10"``, ``"2.0"``, other scripts' digits or a
    fraction cut off. ConfigError naming ``name`` (and ``minimum`` when it is below that)."""
    number = None
    if isinstance(value, bool):
        pass
    elif isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str) and _INT.fullmatch(value):
        try:
            number = int(value)
        except ValueError:  # more digits than int() converts
            pass
    if number is None:
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if number.bit_length() > 3000:  # (str() of thousands of digits raises ValueError: every message did)
        raise ConfigError(f"{name} must be an integer of at most 900 digits, got {_short(value)}")
    if minimum is not None and number < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {number}")
    return number
