"""A tenant label given as any bytes-like object (the media take one: they record its bytes)
works on an encrypted store as on a plain one: its blocks are sealed under that tenant's key,
saved, and loaded back. Real LMDB under tmp_path, real store."""

from __future__ import annotations

import torch

from tests.store.helpers import keys_for, make_store, payloads

SECRET = "correct horse battery staple"
ALICE = b"alice-01"
N = 4


def test_regression_a_save_for_a_bytearray_tenant_was_dropped_when_blocks_are_encrypted(tmp_path):
    """The tenant cipher kept its keys in a dict by label: a bytearray label was unhashable, so
    every write job of the save failed (logged at debug, nothing counted) and the blocks never
    reached the disk; a load for such a label failed the same way. A plain store took both."""
    with make_store(tmp_path, encryption_secret=SECRET) as store:
        keys, data = keys_for(N), payloads(store, N)
        store.save(keys, data, bytearray(ALICE))
        assert store.flush(30)
        assert store.tier("disk").contains(keys) == [True] * N
    with make_store(tmp_path, encryption_secret=SECRET) as store:
        for tenant in (ALICE, bytearray(ALICE)):
            plan = store.load(store.prepare_load(keys, tenant))
            try:
                plan.wait(30)
                assert plan.ok == [True] * N
                assert all(torch.equal(store.slot_tensor(s), p) for s, p in zip(plan.slots, data))
            finally:
                store.release(plan)
        assert store.metrics.misses() == 0
