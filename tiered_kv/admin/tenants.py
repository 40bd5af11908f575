"""Usage per tenant: the bytes a tier holds for each tenant (a ``cache_salt`` label) as its medium
reports them, and the per-tenant quota when one applies. Labels are shown in hex; blocks stored
without a tenant are ``-``."""

from __future__ import annotations

from tiered_kv.admin.opening import Tier

NO_TENANT = "-"


def label(tenant: bytes) -> str:
    """A tenant label as tools show it."""
    return tenant.hex() if tenant else NO_TENANT


def tenant_quota(tier: Tier) -> int | None:
    """Bytes each tenant may hold in ``tier``: the medium's own setting, else the config's."""
    quota = getattr(tier.backend, "tenant_quota", None)
    return quota if isinstance(quota, int) and not isinstance(quota, bool) else tier.tenant_quota


def tenant_usage(tier: Tier) -> dict[str, dict] | None:
    """Per tenant label: ``stored_bytes`` and, under a quota, ``quota_used`` (a fraction); None
    when the medium does not track tenants."""
    report = getattr(tier.backend, "tenant_usage", None)
    usage = report() if callable(report) else None
    if usage is None:
        return None
    quota = tenant_quota(tier)
    return {label(tenant): {"stored_bytes": used,
                            "quota_used": round(used / quota, 4) if quota else None}
            for tenant, used in sorted(usage.items())}
