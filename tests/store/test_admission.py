"""Hit-count admission: with ``admit_after_hits = N`` a block reaches a lower tier only once it
was requested N times (saved after being computed, or loaded), so one-off prompts never wear
the SSD; skipped writes are counted."""

from __future__ import annotations

import torch

from tests.store.helpers import keys_for, load, make_store, payloads


def twice(tmp_path, **extra):
    return make_store(tmp_path, disk={"admit_after_hits": 2}, **extra)


def test_a_block_requested_once_does_not_reach_the_disk_tier(tmp_path):
    with twice(tmp_path) as store:
        keys = keys_for(4)
        store.save(keys, payloads(store, 4))
        store.flush()
        assert store.tier("disk").contains(keys) == [False] * 4
        assert store.lookup(keys) == 4  # still served from host
        assert store.metrics.snapshot()["events"]["admission_skipped"] == 4


def test_a_block_loaded_a_second_time_from_host_is_written_to_disk_then(tmp_path):
    with twice(tmp_path) as store:
        keys = keys_for(4)
        data = payloads(store, 4)
        store.save(keys, data)
        ok, outs = load(store, keys[:2])  # the second request of the first two blocks
        assert all(ok)
        store.flush()
        assert store.tier("disk").contains(keys) == [True, True, False, False]


def test_a_block_computed_again_after_host_eviction_is_admitted(tmp_path):
    with twice(tmp_path, host="64KiB") as store:  # 4 host slots
        keys = keys_for(2)
        data = payloads(store, 2)
        store.save(keys, data)
        store.save(keys_for(4, first_token=10_000), payloads(store, 4, seed=1))  # evicts them
        store.flush()
        assert store.lookup(keys) == 0
        store.save(keys, data)  # the prompt came back and was computed again
        store.flush()
        assert store.tier("disk").contains(keys) == [True, True]


def test_admitted_blocks_survive_a_restart_and_one_off_blocks_were_never_written(tmp_path):
    keys, once = keys_for(3), keys_for(3, first_token=50_000)
    with twice(tmp_path) as store:
        data = payloads(store, 3)
        store.save(keys, data)
        store.save(once, payloads(store, 3, seed=2))
        load(store, keys)
    with twice(tmp_path) as store:
        assert store.tier("disk").backend.stats().entries == 3 + 1  # and the namespace record
        ok, outs = load(store, keys)
        assert all(ok) and all(torch.equal(a, b) for a, b in zip(data, outs))
        assert store.lookup(once) == 0


def test_admission_is_per_tier(tmp_path):
    tiers = [{"name": "shared", "url": f"file://{tmp_path}/shared"}]  # admits at once
    with twice(tmp_path, tiers=tiers) as store:
        keys = keys_for(2)
        store.save(keys, payloads(store, 2))
        store.flush()
        assert store.tier("disk").contains(keys) == [False, False]
        assert store.tier("shared").contains(keys) == [True, True]
        assert store.metrics.snapshot()["events"]["admission_skipped"] == 2


def test_a_block_fetched_from_a_lower_tier_is_copied_up_only_where_admitted(tmp_path):
    tiers = [{"name": "shared", "url": f"file://{tmp_path}/shared"}]
    keys = keys_for(2)
    with make_store(tmp_path, disk=None, tiers=tiers) as store:  # another replica filled it
        data = payloads(store, 2)
        store.save(keys, data)
    with make_store(tmp_path, disk={"admit_after_hits": 3}, tiers=tiers) as store:
        assert all(load(store, keys)[0])  # request 1: served by "shared", not copied up
        assert store.tier("disk").contains(keys) == [False, False]


def test_a_host_block_loaded_again_and_again_is_written_behind_once(tmp_path):
    with twice(tmp_path) as store:
        keys = keys_for(2)
        store.save(keys, payloads(store, 2))
        writes = []
        submit = store.saver._submit_write
        store.saver._submit_write = lambda pinned, *a: (writes.append([k for k, _ in pinned]), submit(pinned, *a))[1]
        for _ in range(4):
            load(store, keys)
        store.flush()
        assert sorted(sum(writes, [])) == sorted(keys), "each later host hit would queue a pointless write job"
        assert store.tier("disk").contains(keys) == [True, True]


def test_a_block_computed_again_while_the_host_still_holds_it_earns_the_tier(tmp_path):
    """A scheduler that only sees the lower tiers (another process, another TP rank's copy
    missing) sends the second request to recompute: its save is the second request."""
    with twice(tmp_path) as store:
        keys = keys_for(3)
        data = payloads(store, 3)
        store.save(keys, data)
        store.save(keys, data)
        store.flush()
        assert store.tier("disk").contains(keys) == [True] * 3


def test_a_block_promoted_from_a_lower_tier_earns_the_tiers_below_it(tmp_path):
    tiers = [{"name": "archive", "url": f"file://{tmp_path}/archive", "admit_after_hits": 3}]
    with make_store(tmp_path, host="64KiB", tiers=tiers) as store:  # 4 host slots
        keys = keys_for(2)
        store.save(keys, payloads(store, 2))  # request 1: disk admits at once
        evict_host = (keys_for(4, first_token=10_000), payloads(store, 4, seed=1))
        for _ in range(2):  # requests 2 and 3, each served by the disk tier
            store.save(*evict_host)
            store.flush()
            assert all(load(store, keys)[0])
        store.flush()
        assert store.tier("archive").contains(keys) == [True, True]


def test_a_forgotten_request_count_never_keeps_a_block_from_a_tier_that_admits_at_once(tmp_path):
    tiers = [{"name": "shared", "url": f"file://{tmp_path}/shared", "admit_after_hits": 2}]
    with make_store(tmp_path, host="64KiB", disk={"policy": "on_evict"}, tiers=tiers) as store:
        store.requests.max_tracked = 8
        keys = keys_for(2)
        store.save(keys, payloads(store, 2))
        store.release(store.prepare_load(keys_for(8, first_token=50_000)))  # their counts are pushed out
        assert store.requests.counts(keys) == [0, 0]
        store.save(keys_for(4, first_token=90_000), payloads(store, 4, seed=3))  # the host evicts them
        store.flush()
        assert store.tier("disk").contains(keys) == [True, True]
