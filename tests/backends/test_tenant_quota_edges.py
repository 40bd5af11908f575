"""Tenant quotas at their edges: an LMDB store with no capacity (a tool's open, or one made for
a tool) keeps its tenant quotas, eviction "beyond the capacity" of a medium with none evicts
nothing, and a quota lowered between runs is met at the tenant's next put, on every medium that
keeps tenants on disk (its usage comes back on reopen: nothing is lost before that put)."""

from __future__ import annotations

import pytest

from storage_backends.eviction import Eviction
from storage_backends.eviction_lru import LRU
from storage_backends.lmdb_disk import LmdbBackend
from storage_backends.recency import RecencyIndex
from storage_backends.registry import open_backend

KiB = 1 << 10
UNIT = 100 * KiB  # one value
A, B = b"tenant-a", b"tenant-b"


def key(tenant: bytes, i: int) -> bytes:
    return tenant[-1:] * 16 + i.to_bytes(16, "big")


def put(backend, tenant: bytes, *numbers: int) -> list[bool]:
    return [backend.put_many([(key(tenant, i), bytes([i]) * UNIT)], tenant=tenant)[0] for i in numbers]


def present(backend, tenant: bytes, numbers) -> list[int]:
    found = backend.contains_many([key(tenant, i) for i in numbers])
    return [i for i, here in zip(numbers, found) if here]


@pytest.mark.parametrize("opened", ["constructor", "create_for_tool"])
def test_an_lmdb_store_without_a_capacity_keeps_its_tenant_quota(opened, tmp_path):
    """The quota used to be dropped with the capacity: A filled the store past its quota."""
    if opened == "constructor":
        backend = LmdbBackend(tmp_path / "db", capacity=None, tenant_quota=3 * UNIT)
    else:
        backend = LmdbBackend.create_for_tool(f"lmdb://{tmp_path}/db?tenant_quota={3 * UNIT}")
    with backend:
        assert backend.capacity is None
        assert put(backend, A, 1, 2, 3, 4) == [True] * 4
        assert present(backend, A, range(1, 5)) == [2, 3, 4]
        assert put(backend, B, 1) == [True] and present(backend, A, range(1, 5)) == [2, 3, 4]
        assert backend.tenant_usage() == {A: 3 * UNIT, B: UNIT}
        assert backend.stats().extra["quota_evictions"] == 1
        backend.pin_many([key(A, i) for i in (2, 3, 4)])
        assert put(backend, A, 5) == [False]  # its own entries are leased: refused, not stored over


def test_an_lmdb_tools_open_without_a_capacity_keeps_the_urls_tenant_quota(tmp_path):
    with open_backend(f"lmdb://{tmp_path}/db?capacity={64 * UNIT}") as backend:
        put(backend, A, 1, 2)
    with LmdbBackend.open_read_only(f"lmdb://{tmp_path}/db?tenant_quota={2 * UNIT}") as backend:
        assert backend.capacity is None
        assert put(backend, A, 3) == [True]
        assert present(backend, A, [1, 2, 3]) == [2, 3]


def test_eviction_beyond_the_capacity_of_a_medium_with_none_evicts_nothing():
    """Measured against 0, every entry was a victim (no caller passes None today)."""
    index = RecencyIndex(lambda _key: False)
    for i in range(4):
        index.add(key(A, i), UNIT, A)
    assert Eviction(LRU, None).beyond_capacity(index, UNIT) == []
    assert Eviction(LRU, 4 * UNIT).beyond_capacity(index, UNIT) == [(key(A, 0), UNIT)]  # (with one: as before)


@pytest.mark.parametrize("medium", ["lmdb", "file"])
def test_a_quota_lowered_between_runs_is_met_at_the_tenants_next_put(medium, tmp_path):
    """Reopened with a smaller quota, a tenant keeps what it holds (usage comes back from disk)
    until its next put evicts its own oldest entries down to the new quota; another tenant under
    its quota loses nothing."""
    url = f"{medium}://{tmp_path}/store?capacity={64 * UNIT}"
    with open_backend(url, tenant_quota=5 * UNIT) as backend:
        assert put(backend, A, 1, 2, 3, 4, 5) == [True] * 5
        assert put(backend, B, 1) == [True]
        backend.put_many([(key(A, 1), bytes(UNIT))], tenant=B)  # B takes over A's 1
    with open_backend(url, tenant_quota=2 * UNIT) as backend:
        assert backend.tenant_usage() == {A: 4 * UNIT, B: 2 * UNIT}
        assert present(backend, A, range(1, 6)) == [1, 2, 3, 4, 5]
        assert put(backend, A, 6) == [True]
        assert present(backend, A, range(2, 7)) == [5, 6]
        assert backend.tenant_usage() == {A: 2 * UNIT, B: 2 * UNIT}
        assert backend.check() == []
