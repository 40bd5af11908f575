"""Usage per tenant: what a tier holds for each tenant (a ``cache_salt`` label) as its medium
reports it (bytes and entries), and each tenant's byte quota where one applies. Labels are shown
in hex; what was stored without a tenant is ``-``."""

from __future__ import annotations

from storage_backends.quotas import NO_QUOTAS, Quotas
from tiered_kv.admin.opening import Tier

NO_TENANT = "-"


def label(tenant: bytes) -> str:
    """A tenant label as tools show it."""
    return tenant.hex() if tenant else NO_TENANT


def default_quota(tier: Tier) -> int | None:
    """Bytes every labelled tenant may hold in ``tier``: the medium's own setting, else the
    config's."""
    return _quotas(tier).default or tier.tenant_quota


def quota_of(tier: Tier, tenant: bytes) -> int | None:
    """Bytes ``tenant`` may hold in ``tier`` (None: no quota); the medium's per-tenant quotas
    first, then the default quota, which only labelled tenants have."""
    return _quotas(tier).per_tenant.get(tenant) or (default_quota(tier) if tenant else None)


def tenant_usage(tier: Tier) -> dict[str, dict] | None:
    """Per tenant label: ``stored_bytes``, ``entries``, ``quota_bytes`` and ``quota_used`` (a
    fraction); None when the medium keeps no figures per tenant."""
    totals = tier.backend.tenant_totals()
    if totals is None:
        return None
    out = {}
    for tenant, total in sorted(totals.items()):
        quota = quota_of(tier, tenant)
        out[label(tenant)] = {"stored_bytes": total.used_bytes, "entries": total.entries, "quota_bytes": quota,
                              "quota_used": round(total.used_bytes / quota, 4) if quota else None}
    return out


def _quotas(tier: Tier) -> Quotas:
    """A config's quotas, as its engine's medium keeps them (a ``tenant_quotas`` table never
    reaches a tool's medium: no URL carries it); else those the medium keeps (media that keep
    none, such as Redis: none)."""
    return tier.quotas if tier.quotas is not None else getattr(tier.backend, "quotas", NO_QUOTAS)
