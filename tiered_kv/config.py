"""Configuration: frozen dataclasses built once from a dict, a TOML file or the environment.

Sections mirror the tiers::

    workers = 2
    [host]
    capacity = "4GiB"
    [disk]
    url = "lmdb:///var/cache/tiered-kv"
    capacity = "64GiB"
    admit_after_hits = 2          # only blocks requested twice reach the SSD
    [remote]
    url = "redis://cache:6379/0"
    ttl = "1d"
    [[tiers]]                     # more lower tiers, in order after disk and remote
    name = "archive"
    url = "file:///mnt/shared/tkv"
    capacity = "2TiB"
    tenant_quota = "100GiB"      # per cache_salt

The lower tiers are looked up, loaded and written in that order (``lower_tiers``); a new medium
needs a backend in ``storage_backends`` and a ``[[tiers]]`` entry, nothing else.

``encryption_secret`` (best from ``TIERED_KV_ENCRYPTION_SECRET`` or a ``file:`` reference, not
the TOML itself) turns on encryption at rest of the lower tiers' blocks
(:mod:`tiered_kv.store.tenant_cipher`); it is a :class:`Secret`, shown as ``<redacted>`` anywhere.

Environment: ``TIERED_KV_<FIELD>`` for top-level fields and ``TIERED_KV_<SECTION>_<FIELD>`` for
section fields (``TIERED_KV_DISK_URL``, ``TIERED_KV_HOST_CAPACITY``). Unknown keys, wrong types,
negative sizes and URLs with no registered backend raise :class:`ConfigError` naming the key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from storage_backends.redaction import redact_url
from tiered_kv.errors import ConfigError
from tiered_kv.settings.loading import build_config, check_types, read_toml
from tiered_kv.settings.loading import env_dict as _env_dict
from tiered_kv.settings.tiers import (  # noqa: F401 (the tiers' settings are part of this module's API)
    MAX_TIMEOUT,
    POLICIES,
    DiskConfig,
    RemoteConfig,
    TierConfig,
    check_choice,
    duration_field,
    size_field,
)
from tiered_kv.units import as_bool

RESTORE_POLICIES = ("cost", "always")
MIN_SECRET_BYTES = 16
SECRET_FILE_MOST = 64 << 10  # the most a ``file:`` secret may hold
MAX_WORKERS = 256  # transfer threads a store may start (each holds a stack; more would not help)
MAX_LOG_INTERVAL = 30 * 86400.0  # (a thread's wait past ~292 years raises OverflowError)


class Secret:
    """A secret kept out of every repr, str, format and log line; ``reveal()`` gives its bytes."""

    __slots__ = ("_value",)

    def __init__(self, value: bytes) -> None:
        self._value = bytes(value)

    def reveal(self) -> bytes:
        return self._value

    def __repr__(self) -> str:
        return "Secret('<redacted>')"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return repr(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and hmac.compare_digest(self._value, other._value)

    def __hash__(self) -> int:
        return hash(hashlib.sha256(b"tiered-kv secret" + self._value).digest())

    def __copy__(self) -> Secret:
        return self

    def __deepcopy__(self, memo: dict) -> Secret:
        return self

    def __reduce__(self):
        return (Secret, (self._value,))


def _secret(key: str, value: Any, environ: Mapping[str, str] | None = None) -> Secret:
    """``value`` as a Secret: the secret itself, ``env:NAME`` (that variable of ``environ``, the
    process's by default) or ``file:PATH`` (that file, ``~`` expanded, a trailing newline
    dropped); never quoted in an error."""
    environ = os.environ if environ is None else environ
    if isinstance(value, Secret):  # (its length checked too: an object skipped the check below)
        value = value.reveal()
    elif isinstance(value, str) and value.startswith("env:"):
        if not environ.get(value[4:]):
            raise ConfigError(f"{key}: the environment variable {value[4:]} is not set")
        value = environ[value[4:]]
    elif isinstance(value, str) and value.startswith("file:"):
        try:
            with open(os.path.expanduser(value[5:]), "rb") as f:
                text = f.read(SECRET_FILE_MOST + 1)  # (bounded: ``file:/dev/zero`` read for ever)
        except OSError as exc:
            raise ConfigError(f"{key}: cannot read {value[5:]} ({type(exc).__name__})") from None
        if len(text) > SECRET_FILE_MOST:
            raise ConfigError(f"{key}: {value[5:]} holds more than {SECRET_FILE_MOST} bytes: not a secret")
        value = text.rstrip(b"\r\n")
    if isinstance(value, str):
        value = value.encode()
    if not isinstance(value, bytes) or len(value) < MIN_SECRET_BYTES:
        raise ConfigError(f"{key} must be a secret of at least {MIN_SECRET_BYTES} bytes (or env:NAME, file:PATH)")
    return Secret(value)



def _bool_or_auto(value: bool | int | str, name: str) -> bool | str:
    """True, False or "auto" from a setting (a bool, 0 / 1, "yes", "off", "auto", …)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return as_bool(value, name)
    except ConfigError:
        raise ConfigError(f"{name} must be true, false or \"auto\", got {value!r}") from None


def layerwise_on(setting: bool | str, device_type: str | None) -> bool:
    """Whether sync loads stream layer by layer under ``layerwise_loads = setting`` on an engine
    whose KV cache lives on ``device_type`` ("cuda", "cpu", …; None: not known yet, taken as an
    accelerator). "auto" streams on accelerators only: on a CPU engine the pool's reads and checks
    run on the cores the forward pass computes on, and layer-wise loads measured 1.1-1.3x slower
    than whole ones there (README, Restore)."""
    if setting == "auto":
        return device_type != "cpu"
    return bool(setting)


@dataclass(frozen=True)
class HostConfig:
    capacity: int = size_field(1 << 30)  # bytes of host slots (pinned when CUDA is present)
    pinned: str = "auto"  # "auto" (pin when CUDA is available), "yes" or "no"
    tenant_quota: int | None = size_field(None)  # bytes of slots each tenant (cache_salt) may hold; None = no quota

    def __post_init__(self) -> None:
        check_types(self, "host.")
        check_choice("host.pinned", self.pinned, ("auto", "yes", "no"))
        if self.tenant_quota is not None and self.tenant_quota <= 0:
            raise ConfigError(f"host.tenant_quota must be positive, got {self.tenant_quota}")


@dataclass(frozen=True)
class TieredKVConfig:
    host: HostConfig = field(default_factory=HostConfig)  # host (CPU) tier
    disk: DiskConfig = field(default_factory=DiskConfig)  # disk (LMDB) tier
    remote: RemoteConfig = field(default_factory=RemoteConfig)  # remote (Redis) tier
    tiers: tuple[TierConfig, ...] = ()  # more lower tiers, in order after disk and remote
    workers: int = 2  # transfer threads (zstd, LMDB and redis-py release the GIL), at most MAX_WORKERS
    max_inflight_save: int = size_field(512 << 20)  # write-behind bytes queued before saves drop
    max_inflight_load: int = size_field(512 << 20)  # load bytes in flight; later loads queue behind them
    lookup_timeout: float = duration_field(0.05)  # scheduler-side lookup deadline per tier; unanswered = miss
    close_timeout: float | None = duration_field(30.0)  # close() waits this long for write-behind, then leaves a hung tier's writes (counted saves_abandoned) and medium to the process's exit; None = wait for ever
    hash_algo: str = "xxh3_128"  # block key hash: xxh3_128, blake2b_128 or sha256_128
    cache_salt: str = field(default="", repr=False)  # tenant salt folded into every key (a secret: in no repr)
    model_revision: str = ""  # weights fingerprint folded into the namespace
    metrics_port: int | None = None  # serve Prometheus metrics on this port; None = off
    metrics_log_interval: float | None = duration_field(None)  # log a one-line traffic summary this often; None = off
    layer_groups: int = 8  # stored blocks are framed in up to this many layer groups, each read and checked alone; 1 = one frame
    layerwise_loads: bool | str = field(default="auto", metadata={"parse": _bool_or_auto})  # sync loads arrive layer group by layer group (wait_for_layer_load waits for one); False = all before the forward; "auto" = on accelerators, not CPU engines
    restore_policy: str = "cost"  # "cost": load the stored prefix that minimizes predicted TTFT; "always": every stored block
    restore_min_samples: int = 3  # restores per tier and engine steps observed before "cost" may skip a load (the floor)
    encryption_secret: Secret | None = field(default=None, metadata={"blank": "refused"})  # encrypt lower-tier blocks (AES-GCM, a key per tenant) with this; env:NAME / file:PATH read it; None (left out) = plain; "" is refused

    def __post_init__(self) -> None:
        check_types(self, "")
        for name, kind in (("host", HostConfig), ("disk", DiskConfig), ("remote", RemoteConfig)):
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(f"{name} must be a {kind.__name__}, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.tiers, tuple) or not all(isinstance(t, TierConfig) for t in self.tiers):
            raise ConfigError("tiers must be a tuple of TierConfig")
        if self.encryption_secret is not None:
            object.__setattr__(self, "encryption_secret", _secret("encryption_secret", self.encryption_secret))
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ConfigError(f"workers must be between 1 and {MAX_WORKERS}, got {self.workers}")
        if isinstance(self.layer_groups, bool) or not isinstance(self.layer_groups, int) or self.layer_groups < 1:
            raise ConfigError(f"layer_groups must be a positive integer, got {self.layer_groups!r}")
        check_choice("restore_policy", self.restore_policy, RESTORE_POLICIES)
        if not (isinstance(self.layerwise_loads, bool) or self.layerwise_loads == "auto"):
            raise ConfigError(f"layerwise_loads must be true, false or \"auto\", got {self.layerwise_loads!r}")
        if self.restore_min_samples < 1:
            raise ConfigError(f"restore_min_samples must be at least 1, got {self.restore_min_samples}")
        from tiered_kv.keys import HASHES

        check_choice("hash_algo", self.hash_algo, tuple(HASHES))
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics_port must be a TCP port, got {self.metrics_port}")
        if not 0 < self.lookup_timeout <= MAX_TIMEOUT:  # a scheduler-side wait (huge: every lookup raised)
            raise ConfigError(f"lookup_timeout must be positive and at most 1d, got {self.lookup_timeout}")
        if self.close_timeout is not None and not 0 < self.close_timeout <= MAX_TIMEOUT:  # (huge: a wait raised)
            raise ConfigError(f"close_timeout must be positive and at most 1d (or none), got {self.close_timeout}")
        if self.metrics_log_interval is not None and not 0 < self.metrics_log_interval <= MAX_LOG_INTERVAL:
            raise ConfigError(f"metrics_log_interval must be positive and at most 30d, got {self.metrics_log_interval}")
        names = [t.name for t in (self.disk, self.remote, *self.tiers)]
        for name in names:
            if names.count(name) > 1:
                raise ConfigError(f"two lower tiers are named {name!r}")

    @property
    def lower_tiers(self) -> tuple[TierConfig, ...]:
        """The lower tiers that are on (a URL given), in the order blocks are looked up, loaded
        and written: disk, remote, then ``tiers``."""
        return tuple(t for t in (self.disk, self.remote, *self.tiers) if t.url)

    # -- constructors ------------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """The settings as written (sections and ``tiers`` as tables): ``from_dict`` of them,
        some changed, is this config with those changed. (``dataclasses.asdict`` gives the medium
        settings the URLs decided as if written: a changed URL saying otherwise was refused.)"""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(host=_table("host", self.host), disk=self.disk.settings(), remote=self.remote.settings(),
                   tiers=[t.settings() for t in self.tiers])
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> TieredKVConfig:
        return build_config(cls, dict(data or {}))

    @classmethod
    def from_toml(cls, path: str | os.PathLike) -> TieredKVConfig:
        return cls.from_dict(read_toml(path))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TieredKVConfig:
        return cls.load(None, environ)

    @classmethod
    def load(cls, source: str | os.PathLike | Mapping[str, Any] | None = None,
             environ: Mapping[str, str] | None = None) -> TieredKVConfig:
        """A dict or a TOML path (or nothing), overlaid with ``TIERED_KV_*`` variables."""
        if source is None:
            base: dict = {}
        elif isinstance(source, Mapping):
            base = dict(source)
        else:
            base = read_toml(source)
        environ = os.environ if environ is None else environ
        for key, value in env_dict(environ).items():
            if isinstance(value, dict):
                base[key] = {**_table(key, base.get(key)), **value}
            else:
                base[key] = value
        secret = base.get("encryption_secret")
        if isinstance(secret, str) and secret.startswith("env:"):  # a variable of ``environ``
            base["encryption_secret"] = _secret("encryption_secret", secret, environ)
        return cls.from_dict(base)

    def with_overrides(self, **changes: Any) -> TieredKVConfig:
        """This config with ``changes`` (checked and parsed as :meth:`from_dict` does)."""
        return type(self).from_dict({**self.settings(), **changes})


def _table(key: str, section: Any) -> dict:
    """A section of a config being overlaid with variables, as a dict of its settings."""
    if section is None:
        return {}
    if isinstance(section, TierConfig):
        return section.settings()  # (not the medium settings its URL decided: a new URL decides them)
    if is_dataclass(section) and not isinstance(section, type):
        return {f.name: getattr(section, f.name) for f in fields(section)}
    if not isinstance(section, Mapping):
        raise ConfigError(f"{key} must be a table of settings, got {redact_url(repr(section))}")
    return dict(section)


def env_dict(environ: Mapping[str, str]) -> dict:
    """The ``TIERED_KV_*`` variables of ``environ`` as a nested dict (values stay strings)."""
    return _env_dict(environ, _sections())


def _sections() -> set[str]:
    """The sections of the config (``TIERED_KV_<SECTION>_<FIELD>`` variables)."""
    return {f.name for f in fields(TieredKVConfig) if is_dataclass(f.default_factory)}  # type: ignore[arg-type]
