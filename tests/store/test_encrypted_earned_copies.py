"""A block a tier admits on its second request is written when that request comes, from the
host copy: with encryption on, that copy must be the requesting tenant's own, never another
tenant's plaintext sealed under the requester's key."""

from __future__ import annotations

import torch

from tests.store.helpers import keys_for, make_store, payloads

SECRET = "correct horse battery staple"
ALICE, BOB = b"alice-01", b"bob--002"


def test_regression_a_second_tenants_save_wrote_the_first_tenants_host_copy_sealed_for_the_second(tmp_path):
    keys = keys_for(2)  # the same keys for both (a caller's own keys, without a salt in them)
    with make_store(tmp_path, encryption_secret=SECRET, disk={"admit_after_hits": 2}) as store:
        alice, bob = payloads(store, 2, seed=1), payloads(store, 2, seed=2)
        store.save(keys, alice, ALICE)  # host only: the disk admits on a second request
        store.flush()
        assert store.tier("disk").contains(keys) == [False, False]
        store.save(keys, bob, BOB)  # the host holds Alice's copy: Bob's request earns nothing of hers
        store.flush()
    with make_store(tmp_path, encryption_secret=SECRET, disk={"admit_after_hits": 2}) as store:
        plan = store.load(store.prepare_load(keys, BOB)).wait(30)
        try:
            got = [store.slot_tensor(s).clone() if s is not None else None for s in plan.slots]
        finally:
            store.release(plan)
    for ok, block, mine, hers in zip(plan.ok, got, bob, alice):
        assert not (ok and torch.equal(block, hers)), "Bob was served Alice's KV"
        assert not ok or torch.equal(block, mine)
