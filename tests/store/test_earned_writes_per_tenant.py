"""A block a tier admits on its second request is written when that request comes. A request
whose tenant does not own the host copy earns nothing of it (another tenant's bytes are never
written as the requester's); that must not cost the owner the tier: their own next request
still writes their block there."""

from __future__ import annotations

import torch

from tests.store.helpers import keys_for, load, make_store, payloads

ALICE, BOB = b"alice-01", b"bob--002"


def test_regression_another_tenants_request_claimed_the_tier_and_the_owners_block_never_reached_it(tmp_path):
    keys = keys_for(2)  # the same keys for both (a caller's own keys, without a salt in them)
    with make_store(tmp_path, disk={"admit_after_hits": 2}) as store:
        alice, bob = payloads(store, 2, seed=1), payloads(store, 2, seed=2)
        store.save(keys, alice, ALICE)  # host only: the disk admits on a second request
        store.save(keys, bob, BOB)  # the host holds Alice's copy: Bob's request writes none of it
        store.flush()
        assert store.tier("disk").contains(keys) == [False, False]
        store.save(keys, alice, ALICE)  # Alice asks again: her block has earned the disk
        store.flush()
        assert store.tier("disk").contains(keys) == [True, True]
    with make_store(tmp_path, host="1MiB", disk={"admit_after_hits": 2}) as store:
        ok, got = load(store, keys)  # a fresh host tier: served by the disk
    assert ok == [True, True]
    assert all(torch.equal(a, b) for a, b in zip(got, alice))


def test_a_repeated_key_in_one_request_takes_one_lease_and_gives_it_back(tmp_path):
    keys = keys_for(1)
    with make_store(tmp_path, disk={"admit_after_hits": 2}) as store:
        block = payloads(store, 1)
        store.save(keys, block)
        store.save(keys * 2, block * 2)  # held already, named twice: earned once
        store.flush()
        assert store.tier("disk").contains(keys) == [True]
        assert store.host.stats().extra["leased"] == 0
        assert store.host.can_reserve(store.host.num_slots)
