"""Scenarios of the tiered store over real LMDB files (and a real Redis where named)."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.store.helpers import NS, keys_for, load, load_staged, make_store, payloads


def test_saved_blocks_are_found_and_loaded_byte_identical_from_host(tmp_path):
    with make_store(tmp_path) as store:
        keys = keys_for(8)
        data = payloads(store, 8)
        store.save(keys, data)
        assert store.lookup(keys) == 8
        ok, outs = load(store, keys)
        assert all(ok)
        assert all(torch.equal(a, b) for a, b in zip(data, outs))
        assert store.metrics.snapshot()["tiers"]["host"]["hits"] == 8


def test_lookup_counts_only_the_leading_run_and_has_no_side_effects(tmp_path):
    with make_store(tmp_path) as store:
        keys = keys_for(6)
        store.save(keys[:2] + keys[3:], payloads(store, 5))
        store.flush()
        before = store.stats()["backends"]
        assert store.lookup(keys) == 2
        assert store.lookup(keys) == 2
        assert store.lookup(keys[3:]) == 3
        assert store.stats()["backends"]["disk"]["gets"] == before["disk"]["gets"]


def test_block_is_invisible_until_its_store_completed_and_a_failed_store_rolls_back(tmp_path):
    with make_store(tmp_path) as store:
        keys = keys_for(3)
        batch = store.prepare_save(keys)
        assert len(batch.slots) == 3
        assert store.lookup(keys) == 0, "phase one must not publish anything"
        store.commit_save(batch, ok=False)
        assert store.lookup(keys) == 0
        assert store.host.stats().used_bytes == 0
        batch = store.prepare_save(keys)
        for slot, p in zip(batch.slots, payloads(store, 3)):
            store.slot_tensor(slot).copy_(p)
        store.commit_save(batch).result(timeout=10)
        assert store.lookup(keys) == 3
        assert store.tier("disk").contains(keys) == [True] * 3


def test_host_eviction_falls_back_to_disk_and_promotes_the_block_again(tmp_path):
    with make_store(tmp_path, host="64KiB") as store:  # 4 host slots of 16 KiB
        keys = keys_for(12)
        data = payloads(store, 12)
        store.save(keys, data)
        store.flush()
        assert store.locate(keys[:1]) == ["disk"], "oldest block was evicted from host"
        ok, outs = load_staged(store, keys[:4])
        assert all(ok) and all(torch.equal(a, b) for a, b in zip(data, outs))
        assert store.locate(keys[:4]) == ["host"] * 4
        snap = store.metrics.snapshot()["tiers"]
        assert snap["disk"]["hits"] == 4


def test_load_into_plain_host_blocks_decodes_straight_into_them_without_taking_host_slots(tmp_path):
    """A caller's CPU memory is host memory already: staging its blocks in host slots would
    only add a copy (and evict what the host tier holds)."""
    with make_store(tmp_path, host="64KiB") as store:  # 4 host slots
        keys, data = keys_for(8), payloads(store, 8)
        store.save(keys, data)
        store.flush()
        held = [k for k, where in zip(keys, store.locate(keys)) if where == "host"]
        ok, outs = load(store, keys)
        assert all(ok) and all(torch.equal(a, b) for a, b in zip(data, outs))
        assert [k for k, where in zip(keys, store.locate(keys)) if where == "host"] == held
        snap = store.metrics.snapshot()["tiers"]
        assert snap["disk"]["hits"] == 8 - len(held) and snap["host"]["hits"] == len(held)


def test_leased_blocks_are_not_evicted_before_their_load_runs(tmp_path):
    with make_store(tmp_path, host="64KiB", disk=None) as store:
        keys = keys_for(4)
        data = payloads(store, 4)
        store.save(keys, data)
        plan = store.prepare_load(keys[:2])
        store.save(keys_for(8, first_token=10_000), payloads(store, 8, seed=1))  # pressure
        store.load(plan).wait()
        assert plan.ok == [True, True]
        assert torch.equal(store.slot_tensor(plan.slots[0]), data[0])
        store.release(plan)


def test_saves_over_the_inflight_budget_are_dropped_and_counted(tmp_path):
    with make_store(tmp_path, host="4MiB", max_inflight_save="16KiB", workers=1) as store:
        gate = threading.Event()
        store.pool.try_submit_save(16 << 10, gate.wait)  # occupy the budget
        fut = store.save(keys_for(4), payloads(store, 4))
        assert fut is None
        assert store.metrics.events["saves_dropped"] == 4
        assert store.lookup(keys_for(4)) == 4, "the host copy stays loadable"
        gate.set()


def test_on_evict_policy_writes_to_disk_only_when_host_evicts(tmp_path):
    with make_store(tmp_path, host="64KiB", disk={"url": f"lmdb://{tmp_path}/e", "policy": "on_evict"}) as store:
        keys = keys_for(6)
        data = payloads(store, 6)
        store.save(keys, data)
        store.flush()
        assert store.tier("disk").contains(keys) == [True, True, False, False, False, False]
        ok, outs = load(store, keys[:2])
        assert all(ok) and torch.equal(outs[1], data[1])


def test_off_policy_never_writes_the_tier(tmp_path):
    with make_store(tmp_path, disk={"url": f"lmdb://{tmp_path}/off", "policy": "off"}) as store:
        store.save(keys_for(3), payloads(store, 3))
        store.flush()
        assert store.tier("disk").contains(keys_for(3)) == [False] * 3


def test_lmdb_capacity_smaller_than_the_data_evicts_instead_of_failing(tmp_path):
    with make_store(tmp_path, host="64KiB", disk="160KiB") as store:
        keys = keys_for(40)
        data = payloads(store, 40)
        for i in range(0, 40, 4):
            store.save(keys[i:i + 4], data[i:i + 4])
            store.flush()  # the host tier is tiny: let write-behind free its slots
        disk = store.stats()["backends"]["disk"]
        assert disk["used_bytes"] <= 160 << 10
        assert disk["evictions"] > 0
        assert store.tier("disk").contains(keys[-1:]) == [True], "newest blocks are kept"
        ok, outs = load(store, keys[-6:])
        assert all(ok) and torch.equal(outs[0], data[-6])


def test_loads_run_in_the_pool_and_do_not_block_the_caller(tmp_path):
    with make_store(tmp_path, host="64KiB") as store:
        keys = keys_for(8)
        store.save(keys, payloads(store, 8))
        store.flush()
        plan = store.prepare_load(keys[:4])  # evicted from host: disk loads
        assert plan.sources == ["lower"] * 4
        disk, disk_answers = store.tier("disk").backend, threading.Event()
        reads = [getattr(disk, name) for name in ("visit_split", "visit_ranges")]

        def slow(read):  # the disk answers only once the caller has its plan back
            return lambda *args, **kwargs: disk_answers.wait(30) and read(*args, **kwargs)

        disk.visit_split, disk.visit_ranges = (slow(read) for read in reads)
        caller = threading.Thread(target=store.load, args=(plan,))
        caller.start()
        caller.join(10)
        assert not caller.is_alive(), "the caller waited for the disk"
        assert not plan.done()
        disk_answers.set()
        plan.wait(timeout=10)
        assert plan.ok == [True] * 4
        store.release(plan)


def test_store_rejects_a_host_tier_too_small_for_one_block(tmp_path):
    from tiered_kv.errors import ConfigError

    with pytest.raises(ConfigError, match="host.capacity"):
        make_store(tmp_path, host="1KiB")


def test_namespace_changes_keys_so_other_models_never_hit(tmp_path):
    from dataclasses import replace

    with make_store(tmp_path) as store:
        store.save(keys_for(2), payloads(store, 2))
        other = keys_for(2, ns=replace(NS, model_id="other-model"))
        assert store.lookup(other) == 0


def test_large_batches_are_copied_by_several_threads_and_land_byte_identical(tmp_path):
    with make_store(tmp_path, host="8MiB", disk=None, workers=3) as store:
        store.copier.min_bytes = 0  # 16 KiB blocks: take the parallel path anyway
        pool, submitted = store.copier._pool, []
        real_submit = pool.submit
        pool.submit = lambda fn: submitted.append(fn) or real_submit(fn)
        keys, data = keys_for(256), payloads(store, 256, seed=5)  # 4 shares of small blocks
        store.save(keys, data)
        outs = [torch.empty_like(d) for d in data]
        assert store.load_into(keys, outs) == [True] * 256
        assert all(torch.equal(o, d) for o, d in zip(outs, data))
        assert len(submitted) == 2 * store.copier.helpers  # both copies were offered to helpers


def test_a_closed_store_hands_its_host_slab_back_without_waiting_for_the_collector(tmp_path):
    """A store is in reference cycles (callbacks, threads): its slab stayed resident after close()
    until a collection ran, which then freed a GiB inside whatever the process timed next."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    store = make_store(tmp_path, host="8MiB")
    keys = keys_for(4)
    store.save(keys, payloads(store, 4))
    assert load(store, keys)[0] == [True] * 4 and load_staged(store, keys)[0] == [True] * 4
    slab = StorageWeakRef(store.host.slab.untyped_storage())
    gc.disable()
    try:
        store.close()
        assert slab.expired()
    finally:
        gc.enable()
