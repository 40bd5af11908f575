"""Tenant labels and the byte quotas media keep per tenant.

A tenant label is bytes of at most 16 (tiered-kv uses 8 bytes of a hash of the ``cache_salt``);
``b""`` is no tenant. ``tenant_quota`` (bytes, or a size string such as ``"1GiB"`` from a URL)
is the quota of every labelled tenant; ``tenant_quotas`` (a mapping of label to bytes) overrides
it per tenant, and is the only way to give unlabelled data (``b""``) a quota. There a label written
as text (a TOML table's keys are) is its hex, as ``tiered-kv inspect`` shows it; ``""`` is no tenant.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tiered_kv.errors import ConfigError
from tiered_kv.units import parse_size

MAX_TENANT = 16  # bytes of a tenant label


def as_tenant(tenant) -> bytes:
    """``tenant`` as a label; ConfigError for anything but bytes of at most MAX_TENANT."""
    if not isinstance(tenant, (bytes, bytearray, memoryview)):
        raise ConfigError(f"a tenant label is bytes, got {type(tenant).__name__}")
    tenant = bytes(tenant)
    if len(tenant) > MAX_TENANT:
        raise ConfigError(f"a tenant label has at most {MAX_TENANT} bytes, got {len(tenant)}")
    return tenant


@dataclass(frozen=True)
class Quotas:
    """Bytes each tenant may hold in one medium (None: no quota)."""

    default: int | None = None  # every labelled tenant
    per_tenant: Mapping[bytes, int] = field(default_factory=dict)  # overrides, b"" included

    def of(self, tenant: bytes) -> int | None:
        return self.per_tenant.get(tenant, self.default if tenant else None)

    def __bool__(self) -> bool:
        return self.default is not None or bool(self.per_tenant)

    @classmethod
    def from_options(cls, medium: str, tenant_quota=None, tenant_quotas=None) -> Quotas:
        """From a medium's options: ``tenant_quota`` as bytes or a size string (None or "" for
        none), ``tenant_quotas`` as a mapping of tenant label to bytes (never from a URL)."""
        default = None if tenant_quota in (None, "") else _positive(tenant_quota, f"{medium} tenant_quota")
        if tenant_quotas is None:
            return cls(default)
        if not isinstance(tenant_quotas, Mapping):
            raise ConfigError(f"{medium} tenant_quotas is a mapping of tenant label (bytes, or their hex) to "
                              f"a size, given in options (not in a URL); got {tenant_quotas!r}")
        per_tenant = {}
        for t, q in tenant_quotas.items():
            label = as_tenant(_from_hex(t) if isinstance(t, str) else t)
            if label in per_tenant:  # (bytes and their hex, or "AB" and "ab": the last one won, unsaid)
                raise ConfigError(f"{medium} tenant_quotas names the tenant {label.hex() or '(none)'} twice")
            per_tenant[label] = _positive(q, f"{medium} tenant_quotas[{t!r}]")
        return cls(default, per_tenant)


NO_QUOTAS = Quotas()


def _from_hex(text: str) -> bytes:
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise ConfigError(f"a tenant label written as text is its hex, as `tiered-kv inspect` shows it "
                          f"(\"\": no tenant); got {text!r}") from None


def _positive(value, name: str) -> int:
    size = parse_size(value, name=name)
    if size <= 0:
        raise ConfigError(f"{name} must be positive (None: no quota), got {value!r}")
    return size
