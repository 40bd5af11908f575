"""The lower tiers' settings: a medium named by URL (``[disk]``, ``[remote]``, ``[[tiers]]``).

A medium setting that is also a field (``capacity``, ``tenant_quota``; the disk's ``sync``; the
remote's ``ttl``, ``timeout``, ``retries``) may be written as the field (a TOML key or a
``TIERED_KV_*`` variable), in the URL's query or in ``options`` (which win over the query, as the
medium reads them). Such a field is None until written: written in the URL or ``options`` only,
it takes that value, so that the config says what the medium is opened with (the field's default
used to be passed over it: ``?sync=true`` opened without fsync); written nowhere, its default
(``MEDIUM_DEFAULTS``); written both ways with different values, it is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from storage_backends.quotas import Quotas
from storage_backends.redaction import redact_url
from storage_backends.redis_options import MAX_TIMEOUT_S as MAX_TIMEOUT  # noqa: F401 (the CLI's bound too)
from storage_backends.redis_options import PARSERS as REDIS_PARSERS
from storage_backends.redis_options import ttl_seconds
from tiered_kv.errors import ConfigError
from tiered_kv.settings.loading import check_types
from tiered_kv.units import as_bool, parse_duration, parse_size

POLICIES = ("write_through", "on_evict", "off")


def size_field(default: int) -> Any:
    return field(default=default, metadata={"parse": parse_size})


def duration_field(default: float | None) -> Any:
    return field(default=default, metadata={"parse": parse_duration})


def check_url(section: str, url: str | None) -> None:
    if url is None:
        return
    from storage_backends.registry import scheme_of  # the registry imports no backend

    try:
        scheme_of(url)
    except ConfigError as exc:
        raise ConfigError(f"{section}.url: {exc}") from None


def check_level(key: str, level: int) -> None:
    if isinstance(level, bool) or not isinstance(level, int) or not -7 <= level <= 22:
        raise ConfigError(f"{key} must be a zstd level in [-7, 22], got {level!r}")


def check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {list(choices)}, got {value!r}")


def _size(value: Any, name: str) -> int:
    return parse_size(value, name=name)


class _Settings(dict):
    """A table of medium settings that can be part of a hashable config (never mutated)."""

    def __hash__(self) -> int:  # type: ignore[override]
        # nested tables in any order; a key JSON cannot hold as its repr (``tenant_quotas`` is
        # keyed by bytes labels: json.dumps raised TypeError, and the config was no dict key)
        return hash(json.dumps(_text_keys(self), sort_keys=True, default=repr))


def _text_keys(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k if isinstance(k, str) else repr(k): _text_keys(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class TierConfig:
    """One lower tier: a medium named by URL, how its blocks are encoded, when blocks are written
    to it, and who may fill it. ``[disk]`` and ``[remote]`` are the two usual ones; more come in
    order from ``[[tiers]]`` tables."""

    name: str = ""  # tier name in metrics, logs, tools and KV events (unique; "host" is taken)
    url: str | None = None  # the medium, e.g. "lmdb:///var/cache/tkv", "file:///mnt/tkv"; None = off
    capacity: int | None = size_field(None)  # bytes of stored blocks before LRU eviction; None = medium decides
    codec: str = "auto"  # "auto" (measured at open: see tiered_kv.store.codec_choice), "raw", "zstd" or "zstd+shuffle"
    level: int = 1  # zstd level (1 is the best speed/ratio trade on KV bytes)
    policy: str = "write_through"  # when host blocks are written here: write_through|on_evict|off
    admit_after_hits: int = 1  # write a block here only once it was requested (saved or loaded) this often
    tenant_quota: int | None = size_field(None)  # bytes each tenant (cache_salt) may hold here; None = no quota
    options: Mapping[str, Any] = field(default_factory=dict)  # medium-specific settings, passed on open

    # medium settings that are fields too: how the URL's query or ``options`` spell them
    MEDIUM_FIELDS: ClassVar[dict[str, Callable[[Any, str], Any]]] = {"capacity": _size, "tenant_quota": _size}
    MEDIUM_DEFAULTS: ClassVar[dict[str, Any]] = {}  # what such a field written nowhere means

    SECTION: ClassVar[str] = "tiers"  # where the settings are written (errors about the name say so)

    def __post_init__(self) -> None:
        key = self.name if isinstance(self.name, str) and self.name else "tier"
        check_types(self, f"{key}." if key == self.name else f"{self.SECTION}.")
        if isinstance(self.url, str) and self.url != self.url.strip():  # blanks around it, as a
            # number's are: a space kept after it (an env file, YAML) opened an empty store at "/x "
            object.__setattr__(self, "url", self.url.strip())
        if not self.name or self.name == "host" or not self.name.replace("_", "").isalnum():
            raise ConfigError(f"{self.SECTION}.name must be a word other than 'host', got {self.name!r}")
        check_url(key, self.url)
        if not isinstance(self.options, Mapping):
            raise ConfigError(f"{key}.options must be a table of settings, got {self.options!r}")
        self._adopt_medium_settings(key)
        self._check_fields()  # (before the medium's check: its words name no field)
        self._check_medium_options(key)
        check_choice(f"{key}.policy", self.policy, POLICIES)
        check_choice(f"{key}.codec", self.codec, ("auto", "raw", "zstd", "zstd+shuffle"))
        check_level(f"{key}.level", self.level)
        if self.capacity is not None and self.capacity <= 0:
            raise ConfigError(f"{key}.capacity must be positive, got {self.capacity}")
        if isinstance(self.admit_after_hits, bool) or self.admit_after_hits < 1:
            raise ConfigError(f"{key}.admit_after_hits must be at least 1, got {self.admit_after_hits!r}")
        if self.tenant_quota is not None and self.tenant_quota <= 0:
            raise ConfigError(f"{key}.tenant_quota must be positive, got {self.tenant_quota}")
        object.__setattr__(self, "options", _Settings(self.options))  # configs are dict keys

    def _check_fields(self) -> None:
        """A medium's own bounds on its fields, once the URL and ``options`` decided them."""

    def _adopt_medium_settings(self, key: str) -> None:
        """Fields not written (None) take what the URL's query or ``options`` say (those win, as
        the medium reads them), else their default; one written both ways, differently, is refused."""
        from storage_backends.options import split_options

        given = {**split_options(self.url)[1], **self.options} if self.url else {}
        object.__setattr__(self, "_written", frozenset(n for n in self.MEDIUM_FIELDS if getattr(self, n) is not None))
        for name, parse in self.MEDIUM_FIELDS.items():
            mine = getattr(self, name)
            if name in given:
                value = parse(given[name], f"{key}.{name}")
                if mine is not None and mine != value:
                    raise ConfigError(f"{key}.{name} is {mine!r}, but the url or options say {given[name]!r}: "
                                      "set it in one place")
                mine = value
            object.__setattr__(self, name, self.MEDIUM_DEFAULTS.get(name) if mine is None else mine)

    def _check_medium_options(self, key: str) -> None:
        """ConfigError for a setting the medium would refuse as it opens (an unknown name in the
        URL's query or ``options``): such a config was built, and refused only as the tier
        opened, in an engine's worker. (Checked by the medium's options module, never the medium.)"""
        if self.url is None or not isinstance(self.options, Mapping):
            return
        from storage_backends.options import check_url_options, split_options

        try:
            check_url_options(self.url, self.medium_options())
        except ConfigError as exc:
            raise ConfigError(f"{key}: {exc}") from None
        quotas = {**split_options(self.url)[1], **self.options}.get("tenant_quotas")
        if quotas is not None:  # its labels and sizes too (a TOML table's labels are text, never bytes)
            try:
                Quotas.from_options(self.url.partition(":")[0], None, quotas)
            except ConfigError as exc:
                raise ConfigError(f"{key}.options.tenant_quotas: {exc}") from None

    def settings(self) -> dict[str, Any]:
        """The settings as written, to build this tier again with some of them changed: a medium
        setting the URL, ``options`` or its default decided is left out (a changed URL decides it
        again; kept, it would be one written twice, or the old URL's)."""
        written = getattr(self, "_written", self.MEDIUM_FIELDS.keys())
        return {f.name: dict(getattr(self, f.name)) if f.name == "options" else getattr(self, f.name)
                for f in fields(self) if f.name not in self.MEDIUM_FIELDS or f.name in written}

    def __repr__(self) -> str:  # the URL's password never shown (configs are logged and printed)
        shown = {f.name: getattr(self, f.name) for f in fields(self) if f.repr}
        shown["url"] = None if self.url is None else redact_url(self.url)
        return f"{type(self).__qualname__}({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def quotas(self) -> Quotas:
        """The tenant quotas its medium is opened with (``tenant_quota``, written anywhere, is the
        field; ``tenant_quotas`` comes from ``options`` only)."""
        return Quotas.from_options(self.name, self.tenant_quota, self.options.get("tenant_quotas"))

    def medium_options(self) -> dict[str, Any]:
        """What the medium is opened with: its own settings, the capacity and the quota."""
        out = dict(self.options)
        if self.capacity is not None:
            out["capacity"] = self.capacity
        if self.tenant_quota is not None:
            out["tenant_quota"] = self.tenant_quota
        return out


@dataclass(frozen=True, repr=False)
class DiskConfig(TierConfig):
    """The local disk tier (``[disk]``), first of the lower tiers."""

    name: str = "disk"  # tier name in metrics, logs and tools
    SECTION: ClassVar[str] = "disk"
    capacity: int | None = size_field(None)  # bytes of stored (compressed) blocks before LRU eviction; 8 GiB
    sync: bool | None = None  # fsync every commit (True) or leave it to flush()/the OS (False, the default)

    MEDIUM_FIELDS: ClassVar[dict[str, Callable[[Any, str], Any]]] = {**TierConfig.MEDIUM_FIELDS, "sync": as_bool}
    MEDIUM_DEFAULTS: ClassVar[dict[str, Any]] = {"capacity": 8 << 30, "sync": False}

    def medium_options(self) -> dict[str, Any]:
        return {**super().medium_options(), "sync": self.sync}


@dataclass(frozen=True, repr=False)
class RemoteConfig(TierConfig):
    """The shared remote tier (``[remote]``, Redis), after the disk tier."""

    name: str = "remote"  # tier name in metrics, logs and tools
    SECTION: ClassVar[str] = "remote"
    ttl: float | None = duration_field(None)  # seconds a block lives in Redis; None = no expiry
    timeout: float | None = duration_field(None)  # socket timeout per Redis call, seconds; 2 s
    retries: int | None = None  # retries with backoff before a call counts as remote_unavailable; 2

    MEDIUM_FIELDS: ClassVar[dict[str, Callable[[Any, str], Any]]] = {
        **TierConfig.MEDIUM_FIELDS, "ttl": REDIS_PARSERS["ttl"], "timeout": REDIS_PARSERS["timeout"],
        "retries": REDIS_PARSERS["retries"]}  # (as the Redis medium reads them)
    MEDIUM_DEFAULTS: ClassVar[dict[str, Any]] = {"timeout": 2.0, "retries": 2}

    def _check_fields(self) -> None:
        if self.retries < 0:
            raise ConfigError(f"remote.retries must not be negative, got {self.retries}")
        if not 0 < self.timeout <= MAX_TIMEOUT:  # 0: TensorRT-LLM's matched reads, waited for this
            # long, never finish; past ~292 years every socket call raises OverflowError
            raise ConfigError(f"remote.timeout must be positive and at most 1d, got {self.timeout}")
        ttl_seconds(self.ttl, "remote.ttl")

    def medium_options(self) -> dict[str, Any]:
        return {**super().medium_options(), "ttl": self.ttl, "timeout": self.timeout,
                "retries": self.retries}
