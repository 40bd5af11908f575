"""Byte quotas per tenant, the same rule on every medium that keeps them (host slab, LMDB, file
directory): a tenant over its quota loses its own least recently used entries, never another
tenant's; a put that its own unpinned entries cannot make room for is refused; the medium's
capacity is then kept by plain LRU over everyone. Redis takes the label and refuses quotas."""

from __future__ import annotations

import pytest

from storage_backends.registry import open_backend
from tiered_kv.errors import ConfigError

KiB = 1 << 10
UNIT = 100 * KiB  # one value
A, B = b"tenant-a", b"tenant-b"


@pytest.fixture(params=["host", "lmdb", "file"])
def medium(request, tmp_path):
    """Open the medium with keyword options (a quota in values of UNIT bytes, a capacity)."""
    opened = []

    def open_(quota_units: int | None = 3, capacity_units: int = 64, **options):
        if quota_units is not None:
            options["tenant_quota"] = quota_units * UNIT
        capacity = capacity_units * UNIT
        url = {"host": f"host://?capacity={capacity_units * 512 * KiB}&slot=512KiB",
               "lmdb": f"lmdb://{tmp_path}/db?capacity={capacity}",
               "file": f"file://{tmp_path}/files?capacity={capacity}"}[request.param]
        backend = open_backend(url, **options)
        opened.append(backend)
        return backend

    yield open_
    for backend in opened:
        backend.close()


def key(tenant: bytes, i: int) -> bytes:
    return tenant[-1:] * 16 + i.to_bytes(16, "big")


def put(backend, tenant: bytes, *numbers: int, size: int = UNIT) -> list[bool]:
    return [backend.put_many([(key(tenant, i), bytes([i]) * size)], tenant=tenant)[0] for i in numbers]


def present(backend, tenant: bytes, numbers) -> list[int]:
    found = backend.contains_many([key(tenant, i) for i in numbers])
    return [i for i, here in zip(numbers, found) if here]


def test_a_tenant_over_its_quota_evicts_only_its_own_oldest(medium):
    backend = medium(quota_units=3)
    assert put(backend, A, 1, 2, 3) == [True] * 3
    assert put(backend, B, 1, 2, 3) == [True] * 3
    backend.get_many([key(A, 1)])  # A's 2 is now its least recently used
    assert put(backend, A, 4) == [True]
    assert present(backend, A, range(1, 5)) == [1, 3, 4]
    assert present(backend, B, range(1, 4)) == [1, 2, 3]
    stats = backend.stats()
    assert (stats.evictions, stats.extra["quota_evictions"]) == (1, 1)
    assert backend.tenant_usage() == {A: 3 * UNIT, B: 3 * UNIT}


def test_a_put_its_own_pinned_entries_cannot_make_room_for_is_refused(medium):
    backend = medium(quota_units=3)
    put(backend, A, 1, 2, 3)
    put(backend, B, 1)
    backend.pin_many([key(A, i) for i in (1, 2, 3)])
    before = backend.stats()
    assert put(backend, A, 4) == [False]
    after = backend.stats()
    assert after.put_rejected == before.put_rejected + 1 and after.evictions == before.evictions
    assert present(backend, A, range(1, 5)) == [1, 2, 3] and present(backend, B, [1]) == [1]
    backend.unpin_many([key(A, i) for i in (1, 2, 3)])
    assert put(backend, A, 4) == [True]
    assert present(backend, A, range(1, 5)) == [2, 3, 4]


def test_room_a_tenant_cannot_make_costs_it_nothing(medium):
    backend = medium(quota_units=3)
    put(backend, A, 1, 2)
    backend.pin_many([key(A, 1)])
    assert put(backend, A, 3, size=3 * UNIT) == [False]  # only A's 2 could go: not enough
    assert present(backend, A, [1, 2]) == [1, 2]
    assert put(backend, A, 4, size=4 * UNIT) == [False]  # larger than the quota itself
    assert present(backend, A, [1, 2]) == [1, 2] and backend.stats().evictions == 0


def test_the_capacity_is_kept_by_plain_lru_over_everyone(medium):
    backend = medium(quota_units=3, capacity_units=4)
    put(backend, B, 1)
    put(backend, A, 1, 2)
    put(backend, B, 2)
    assert put(backend, A, 3) == [True]  # within A's quota: the oldest of all goes, B's 1
    assert present(backend, B, [1, 2]) == [2] and present(backend, A, [1, 2, 3]) == [1, 2, 3]
    stats = backend.stats()
    assert (stats.evictions, stats.extra["quota_evictions"]) == (1, 0)


def test_quotas_per_tenant_override_the_default_and_unlabelled_data_has_none(medium):
    backend = medium(quota_units=3, tenant_quotas={A: 1 * UNIT})
    assert put(backend, A, 1, 2) == [True, True]
    assert present(backend, A, [1, 2]) == [2]
    assert put(backend, B, 1, 2, 3, 4) == [True] * 4 and present(backend, B, range(1, 5)) == [2, 3, 4]
    assert put(backend, b"", *range(1, 8)) == [True] * 7  # no label, no quota
    assert backend.tenant_usage() == {A: UNIT, B: 3 * UNIT, b"": 7 * UNIT}


def test_usage_per_tenant_follows_deletes_overwrites_and_evictions(medium):
    backend = medium(quota_units=2)
    put(backend, A, 1, 2)
    put(backend, B, 1)
    assert {t: (u.used_bytes, u.entries) for t, u in backend.tenant_totals().items()} == \
        {A: (2 * UNIT, 2), B: (UNIT, 1)}
    # B takes over A's key 1 (an overwrite moves the bytes to its new owner)
    assert backend.put_many([(key(A, 1), bytes(UNIT // 2))], tenant=B) == [True]
    assert backend.tenant_usage() == {A: UNIT, B: UNIT + UNIT // 2}
    assert backend.delete_many([key(B, 1)]) == 1
    assert backend.tenant_usage() == {A: UNIT, B: UNIT // 2}
    put(backend, A, 3, 4)  # A's quota: its 2 goes
    assert backend.tenant_usage() == {A: 2 * UNIT, B: UNIT // 2}
    assert backend.delete_many([key(A, 3), key(A, 4), key(A, 1)]) == 3
    assert backend.tenant_usage() == {}


def test_tenant_labels_are_bytes_of_at_most_16(medium):
    backend = medium()
    for bad in (b"x" * 17, "text"):
        with pytest.raises(ConfigError, match="tenant label"):
            backend.put_many([(b"k", b"v")], tenant=bad)
    assert backend.put_many([(b"k", b"v")], tenant=b"x" * 16) == [True]


def test_quota_options_are_checked_when_the_medium_opens(medium):
    for options, match in (({"quota_units": None, "tenant_quota": "lots"}, "tenant_quota"),
                           ({"quota_units": None, "tenant_quota": 0}, "must be positive"),
                           ({"tenant_quotas": "A=1GiB"}, "mapping"),
                           ({"tenant_quotas": {b"x" * 17: 1}}, "tenant label")):
        with pytest.raises(ConfigError, match=match):
            medium(**options)
    assert medium(quota_units=None, tenant_quota="1GiB").tenant_quota == 1 << 30


def test_redis_takes_the_label_and_refuses_a_quota(redis_url):
    with open_backend(redis_url) as backend:
        assert backend.put_many([(b"k", b"v")], tenant=A) == [True]
        assert backend.get_many([b"k"]) == [b"v"] and backend.tenant_usage() is None
    for url, options in ((f"{redis_url}?tenant_quota=1GiB", {}), (redis_url, {"tenant_quota": 1 << 30}),
                         (redis_url, {"tenant_quotas": {A: 1}})):
        with pytest.raises(ConfigError, match="maxmemory-policy"):
            open_backend(url, **options)
