"""What does not happen is counted under the name of what happened: a block withdrawn while it
was loaded did not fail to load (it was never read), whichever load path met it; a save of a
key another save or load is storing right now, or twice in one call, found room (it is in
flight), and one refused because a withdrawn copy of its key is still being read is a drop
with its own name, as is one refused because a failed layer-wise load still holds its key's
slot (nothing was withdrawn). ``saves_no_room`` is what the README says: no slot to be had."""

from __future__ import annotations

import threading

import pytest

from tests.store.helpers import keys_for, load, load_staged, make_store, payloads


def stored_on_disk_only(store, keys) -> None:
    store.save(keys, payloads(store, len(keys)))
    store.flush(10)
    store.host.delete_many(keys)


def busy_worker(store) -> threading.Event:
    """The pool's only worker held: delete jobs and staged loads wait until the gate opens."""
    gate, started = threading.Event(), threading.Event()
    store.pool.submit_load(0, lambda: (started.set(), gate.wait(10)))
    assert started.wait(5)
    return gate


@pytest.mark.parametrize("path", ["direct", "staged_withdrawn_before_load", "staged_withdrawn_after_load"])
def test_regression_a_withdrawn_block_counted_as_a_failed_load_on_one_path_only(tmp_path, path):
    with make_store(tmp_path, workers=1) as store:
        key = keys_for(1)
        stored_on_disk_only(store, key)
        gate = busy_worker(store)  # the withdrawal's delete waits: the disk still holds the block
        if path == "direct":
            store.invalidate(key)
            ok, _ = load(store, key)
            reasons = ["invalidated"] if ok == [False] else ok
        else:
            if path == "staged_withdrawn_before_load":
                store.invalidate(key)
            plan = store.loader.load(store.prepare_load(key))
            if path == "staged_withdrawn_after_load":
                store.invalidate(key)  # its job has not read yet
            gate.set()
            plan.wait(10)
            reasons = list(plan.reasons)
            store.release(plan)
        gate.set()
        store.flush(10)
        assert reasons == ["invalidated"]
        assert store.metrics.events["loads_failed"] == 0
        assert store.metrics.tiers["host"].misses["invalidated"] == 1


def test_a_corrupt_and_an_absent_block_are_counted_alike_on_both_load_paths(tmp_path):
    counted = []
    for path, loader in (("direct", load), ("staged", load_staged)):
        with make_store(tmp_path / path, workers=1) as store:
            keys = keys_for(3)
            stored_on_disk_only(store, keys)
            disk = store.tier("disk")
            assert disk.backend.put_many([(disk.ns + keys[1], b"\0" * 4096)]) == [True]
            disk.backend.delete_many([disk.ns + keys[2]])
            ok, _ = loader(store, keys)
            snap = store.metrics.snapshot()
            counted.append((ok, snap["events"].get("loads_failed"), {t: c["misses"] for t, c in snap["tiers"].items()}))
    assert counted[0] == counted[1] and counted[0][:2] == ([True, False, False], 2)


def test_regression_a_save_of_a_key_another_save_is_filling_was_counted_no_room(tmp_path):
    with make_store(tmp_path) as store:  # every slot free
        key = keys_for(1)
        first = store.prepare_save(key)  # another request's save of the same block, being filled
        second = store.prepare_save(key)
        assert second.keys == [] and second.skipped == 1
        store.commit_save(first, ok=False)
        assert store.metrics.events["saves_no_room"] == 0 and store.metrics.events["saves_in_flight"] == 1


def test_regression_a_key_twice_in_one_save_was_counted_no_room(tmp_path):
    with make_store(tmp_path) as store:
        key = keys_for(1)
        batch = store.prepare_save(key + key)
        assert batch.keys == key
        store.commit_save(batch, ok=False)
        assert store.metrics.events["saves_no_room"] == 0


def test_regression_a_save_of_a_key_a_load_is_promoting_was_counted_no_room(tmp_path):
    with make_store(tmp_path, workers=1) as store:
        key = keys_for(1)
        stored_on_disk_only(store, key)
        reading, go = threading.Event(), threading.Event()
        disk = store.tier("disk")
        read = disk.read_into

        def held_read(*args, **kwargs):
            reading.set()
            go.wait(10)
            return read(*args, **kwargs)

        disk.read_into = held_read
        plan = store.loader.load(store.prepare_load(key))  # its job reserved the key's slot
        assert reading.wait(10)
        store.commit_save(store.prepare_save(key))  # the engine saves the same block meanwhile
        go.set()
        plan.wait(10)
        store.release(plan)
        assert plan.ok == [True]
        assert store.metrics.events["saves_no_room"] == 0 and store.metrics.events["saves_in_flight"] == 1


def test_a_save_refused_because_a_load_still_reads_the_withdrawn_copy_is_a_named_drop(tmp_path):
    with make_store(tmp_path) as store:
        key = keys_for(1)
        store.save(key, payloads(store, 1))
        plan = store.prepare_load(key)  # a load leases the host copy
        store.invalidate(key).result(10)  # withdrawn: the lease keeps reading it
        batch = store.prepare_save(key)  # the recomputed block
        assert batch.keys == []
        store.release(plan)
        assert store.metrics.events["saves_no_room"] == 0
        assert store.metrics.events["saves_dropped_withdrawn"] == 1
        store.save(key, payloads(store, 1))  # the lease over, the next save is stored
        assert store.host.contains_many(key) == [True]


def test_regression_a_save_refused_by_a_failed_layer_wise_loads_slot_was_counted_withdrawn(tmp_path):
    with make_store(tmp_path) as store:
        key = keys_for(1)  # stored nowhere: the load misses
        plan = store.loader.load(store.prepare_load(key), layered=True)
        assert plan.wait(10).reasons[0] is not None  # failed: its slot held until the release
        batch = store.prepare_save(key)  # the engine computes the block and saves it
        assert batch.keys == []
        store.release(plan)
        assert store.metrics.events["saves_dropped_withdrawn"] == 0, "nothing was withdrawn"
        assert store.metrics.events["saves_held_by_failed_load"] == 1
        assert store.metrics.events["saves_no_room"] == store.metrics.events["saves_in_flight"] == 0
        store.save(key, payloads(store, 1))  # the load released, the next save is stored
        assert store.host.contains_many(key) == [True]
