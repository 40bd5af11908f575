"""A batch of whole-slot reservations into free slots is booked in one step (no step per key):
it must hand out the same slots, in the same order, and leave the slab in the same state as
reserving the keys one at a time would: duplicates and keys already held get None, the
recency order is the keys' order, and tenants are charged a whole slot each."""

from __future__ import annotations

from storage_backends.host import HostBackend

KiB = 1 << 10
SLOT = 64 * KiB
A = b"tenant-a"


def host(slots: int = 8, **options) -> HostBackend:
    return HostBackend(capacity=slots * SLOT, slot_bytes=SLOT, pinned=False, **options)


def test_a_batch_gets_the_slots_one_at_a_time_reservations_would():
    batched, single = host(), host()
    keys = [b"k%d" % i for i in range(5)]
    assert batched.reserve_many(keys) == [single.reserve_many([k])[0] for k in keys] == [0, 1, 2, 3, 4]


def test_a_key_twice_in_a_batch_or_already_held_gets_no_second_slot():
    h = host()
    h.put_many([(b"held", b"x")])
    assert h.reserve_many([b"a", b"held", b"a", b"b"]) == [1, None, None, 2]
    h.commit_many([b"a", b"b"])
    assert h.stats().entries == 3 and h.tenant_usage() == {b"": 1 + 2 * SLOT}


def test_a_batch_is_evicted_in_the_order_it_was_reserved():
    h = host(slots=4)
    h.reserve_many([b"k0", b"k1", b"k2", b"k3"], tenant=A)
    h.commit_many([b"k0", b"k1", b"k2", b"k3"])
    assert h.tenant_usage() == {A: 4 * SLOT}
    h.reserve_many([b"n0", b"n1"], tenant=A)  # no free slot: the slow path evicts the oldest
    assert h.contains_many([b"k0", b"k1", b"k2", b"k3"]) == [False, False, True, True]


def test_a_batch_larger_than_the_free_slots_evicts_for_the_rest():
    h = host(slots=4)
    h.put_many([(b"old0", b"x"), (b"old1", b"y")])
    assert None not in h.reserve_many([b"n0", b"n1", b"n2"])  # 2 free, then old0 goes
    assert h.contains_many([b"old0", b"old1"]) == [False, True] and h.stats().evictions == 1


def test_a_closed_slab_reserves_nothing():
    h = host()
    h.close()
    assert h.reserve_many([b"a", b"b"]) == [None, None]
