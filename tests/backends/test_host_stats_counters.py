"""The host tier's figures (entries, used bytes, leased entries, per-tenant totals, room for a
reservation) are counts kept as entries change, never a scan: after every call of every kind
they equal a full recount of the entries, and a scrape reads them while an engine call holds
the tier's lock. Real slabs, nothing mocked; the recount looks at the entries themselves."""

from __future__ import annotations

import random
import threading

import pytest

from storage_backends.host import HostBackend

KiB = 1 << 10
SLOT = 4 * KiB
A, B, C = b"tenant-a", b"tenant-b", b""


def host(slots: int = 8, **options) -> HostBackend:
    return HostBackend(capacity=slots * SLOT, slot_bytes=SLOT, pinned=False, **options)


def recount(h: HostBackend) -> dict:
    """Every figure, counted afresh from the entries (under the tier's lock)."""
    with h._lock:
        entries, free = list(h._entries.values()), len(h._free)
    tenants: dict[bytes, tuple[int, int]] = {}
    for e in entries:
        used, n = tenants.get(e.tenant, (0, 0))
        tenants[e.tenant] = (used + e.length, n + 1)
    evictable = sum(1 for e in entries if e.ready and not e.refs)
    return {"entries": sum(1 for e in entries if e.ready), "used_bytes": sum(e.length for e in entries),
            "leased": sum(1 for e in entries if e.refs), "tenants": tenants, "room": free + evictable}


def assert_exact(h: HostBackend) -> dict:
    truth, stats = recount(h), h.stats()
    assert (stats.entries, stats.used_bytes, stats.extra["leased"]) == \
        (truth["entries"], truth["used_bytes"], truth["leased"]), "a kept count drifted from the entries"
    assert {t: tuple(v) for t, v in h.tenant_totals().items()} == truth["tenants"]
    assert h.can_reserve(truth["room"]) and not h.can_reserve(truth["room"] + 1)
    return truth


def test_counts_stay_exact_through_puts_overwrites_by_another_tenant_deletes_and_evictions():
    h = host(slots=4)
    h.put_many([(b"a1", b"1" * 100), (b"a2", b"2" * 200)], tenant=A)
    assert_exact(h)
    h.put_many([(b"a1", b"x" * 300)], tenant=B)  # overwritten, and now B's
    assert assert_exact(h)["tenants"] == {A: (200, 1), B: (300, 1)}
    assert h.delete_many([b"a2", b"nope"]) == 1
    assert_exact(h)
    h.put_many([(bytes([i]), b"v" * (i + 1)) for i in range(7)], tenant=C)  # 4 slots: evictions
    truth = assert_exact(h)
    assert h.stats().evictions > 0 and truth["entries"] == 4


def test_counts_stay_exact_through_quota_evictions():
    h = host(slots=8, tenant_quota=3 * SLOT)
    for i in range(6):
        h.put_many([(b"a%d" % i, b"a" * SLOT)], tenant=A)
        h.put_many([(b"b%d" % i, b"b" * 10)], tenant=B)
        assert_exact(h)
    assert h.stats().extra["quota_evictions"] == 3
    assert recount(h)["tenants"][A] == (3 * SLOT, 3)


def test_counts_stay_exact_through_leases_withdrawals_and_failed_loads():
    h = host(slots=8)
    assert None not in h.reserve_many([b"k1", b"k2", b"k3", b"k4", b"k5"], tenant=A)
    assert assert_exact(h)["entries"] == 0  # reserved: bytes held, no entry yet
    h.commit_many([b"k1", b"k2"], pin=True)  # a save's slots, leased as they become visible
    h.pin_many([b"k1", b"k1"])  # two loads lease k1 again
    assert assert_exact(h)["leased"] == 2
    assert h.retire_many([b"k1"]) == 1  # withdrawn while leased: held until the last lease ends
    h.unpin_many([b"k1", b"k1"])
    assert_exact(h)
    h.unpin_many([b"k1"])  # its last lease: dropped
    assert h.states_many([b"k1"]) == [None]
    assert_exact(h)
    assert h.retire_many([b"k3"]) == 1  # withdrawn while being filled: its commit drops it
    h.commit_many([b"k3"])
    assert_exact(h)
    assert h.retire_many([b"k4"], withdrawn=False) == 1  # a failed load's reservation...
    h.commit_many([b"k4"], pin=True)  # ...committed leased, never published
    assert h.states_many([b"k4"]) == ["failed"]
    assert assert_exact(h)["leased"] == 2
    h.unpin_many([b"k4", b"k2"])
    h.abort_many([b"k5"])
    assert h.pin_many([b"k2"], tenant=B) == [None]  # another tenant's: no lease taken
    truth = assert_exact(h)
    assert (truth["entries"], truth["leased"]) == (1, 0)


def test_a_reservation_that_raised_midway_leaves_every_count_as_it_was():
    h = host(slots=8)
    h.put_many([(b"old", b"o" * 10)], tenant=A)
    before = assert_exact(h)
    with pytest.raises(IndexError):  # a length short: the keys reserved before it are rolled back
        h.reserve_many([b"n1", b"n2"], lengths=[10], tenant=B)
    assert assert_exact(h) == before


CALLS = ["put"] * 4 + ["reserve", "batch"] + ["commit", "pin", "unpin", "abort"] * 2 + ["retire", "delete"]


@pytest.mark.parametrize("seed", range(4))
def test_counts_stay_exact_through_a_random_mix_of_every_call(seed):
    rng = random.Random(seed)
    h = host(slots=6, tenant_quota=3 * SLOT, on_evict=lambda key, value, tenant: None)
    keys, tenants = [b"k%d" % i for i in range(10)], [A, B, C]
    leased: list[bytes] = []
    for _ in range(600):
        key, tenant, call = rng.choice(keys), rng.choice(tenants), rng.choice(CALLS)
        if call == "put":
            h.put_many([(key, b"v" * rng.randint(1, SLOT))], tenant=tenant)
        elif call == "reserve":
            h.reserve_many([key], lengths=[rng.randint(1, SLOT)], tenant=tenant)
        elif call == "batch":  # whole slots, a key maybe twice
            h.reserve_many([rng.choice(keys) for _ in range(3)], tenant=tenant)
        elif call == "commit":
            pin = rng.random() < 0.5
            leased += [key] if pin and h.reserved(key) else []
            h.commit_many([key], pin=pin)
        elif call == "pin":
            leased += [key] if h.pin_many([key]) != [None] else []
        elif call == "unpin" and leased:
            h.unpin_many([leased.pop(rng.randrange(len(leased)))])
        elif call == "retire":
            h.retire_many([key], withdrawn=rng.random() < 0.5)
        elif call == "abort":
            h.abort_many([key])
        elif call == "delete":
            h.delete_many([key])
        assert_exact(h)
    stats = h.stats()
    assert stats.evictions and stats.extra["quota_evictions"] and stats.deletes, "the mix missed a path"


def test_regression_a_closed_host_tier_reported_its_old_entries_with_0_bytes():
    h = host(slots=4)
    h.put_many([(b"a", b"1"), (b"b", b"2")], tenant=A)
    h.pin_many([b"a"])
    h.close()
    stats = h.stats()
    assert (stats.entries, stats.used_bytes, stats.extra["leased"]) == (0, 0, 0)
    assert not h.can_reserve(1)


def test_regression_stats_scanned_every_entry_under_the_lock_the_engine_waits_on():
    # stats() counted leased entries by visiting every entry under the host lock: a scrape held
    # up every lookup, pin and save meanwhile (about 7 ms at 250k entries), and waited for them
    h = host(slots=64)
    h.put_many([(b"k%d" % i, b"v" * 10) for i in range(50)], tenant=A)
    h.pin_many([b"k1", b"k2"])
    truth = recount(h)
    got: list = []
    done = threading.Event()

    def scrape() -> None:
        got.append(h.stats())
        done.set()

    with h._lock:  # an engine call holds the tier
        threading.Thread(target=scrape, daemon=True).start()
        came = done.wait(30)
    assert came, "the figures waited for the host lock"
    assert (got[0].entries, got[0].used_bytes, got[0].extra["leased"]) == (50, 500, truth["leased"]) == (50, 500, 2)
