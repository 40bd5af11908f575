"""Copies up (a block a lower tier served, written into the tiers above it) are write-behind: a
restore never waits on a hung tier above for longer than a bound, a block is copied once however
many loads read it at once, a withdrawal still wins over a copy being written, and a copy the
closing store refuses is counted as what it is."""

from __future__ import annotations

import threading

import pytest

from tests.store.helpers import keys_for, load, load_staged, make_store, payloads
from tiered_kv.store.records import NAMESPACE_PREFIX


def shared_tier(tmp_path, *key_lists) -> list[dict]:
    """A shared tier (below the disk tier) holding the blocks of ``key_lists``, saved by another replica."""
    tiers = [{"name": "shared", "url": f"file://{tmp_path}/shared"}]
    with make_store(tmp_path, disk=None, tiers=tiers) as other_replica:
        for keys in key_lists:
            other_replica.save(keys, payloads(other_replica, len(keys)))
    return tiers


def blocks_in(items) -> list[bytes]:
    return [k for k, _ in items if not k.startswith(NAMESPACE_PREFIX)]  # (not the namespace record)


@pytest.mark.parametrize("loader", [load_staged, load], ids=["through_host_slots", "into_callers_memory"])
def test_a_restore_past_the_write_behind_budget_does_not_wait_on_a_hung_tier_above(tmp_path, loader):
    """Past the budget the restore wrote its copy up itself, on the caller's thread: a disk that
    hung (a stalled network disk, another process holding LMDB's writer lock) held the load, and
    the forward pass waiting on it, for as long as it hung."""
    # (a block each: one load job, one copy up, on either path)
    first, second, third = keys_for(1), keys_for(1, first_token=5_000), keys_for(1, first_token=9_000)
    tiers = shared_tier(tmp_path, first, second, third)
    with make_store(tmp_path, tiers=tiers, max_inflight_save=1) as store:  # one job in flight at a time
        disk, answers = store.tier("disk").backend, threading.Event()
        put_many = disk.put_many
        disk.put_many = lambda items, **kw: (not blocks_in(items) or answers.wait(60)) and put_many(items, **kw)
        assert loader(store, first)[0] == [True]  # its copy up is queued, holds the budget and hangs
        restored: dict = {}
        engine = threading.Thread(target=lambda: restored.update(second=loader(store, second)[0],
                                                                 third=loader(store, third)[0]))
        engine.start()
        engine.join(10)
        try:
            assert not engine.is_alive(), "the restore waited on the hung disk tier"
            assert restored == {"second": [True], "third": [True]}
            # the second restore's copy is still being written: the third's was dropped, counted
            assert store.metrics.events["copies_up_dropped"] == 1
            withdrawn = store.invalidate(second)
            assert not withdrawn.done(), "the delete must follow the copy still being written"
        finally:
            answers.set()
            engine.join(30)
        withdrawn.result(30)
        store.flush()
        assert store.tier("disk").contains(first) == [True]
        assert store.tier("disk").contains(second) == [False]  # the delete won
        assert store.tier("disk").contains(third) == [False]
        assert store.metrics.events.get("saves_dropped", 0) == 0


def test_two_loads_reading_the_same_blocks_at_once_do_not_copy_each_up_twice(tmp_path):
    keys = keys_for(3)
    tiers = shared_tier(tmp_path, keys)
    with make_store(tmp_path, tiers=tiers, workers=4) as store:
        disk, writes = store.tier("disk").backend, threading.Event()
        put_many, written, entered = disk.put_many, [], threading.Semaphore(0)

        def held_put(items, **kwargs):
            if blocks_in(items):
                entered.release()
                writes.wait(30)  # the first copy up is being written while the second load reads
            written.extend(blocks_in(items))
            return put_many(items, **kwargs)

        disk.put_many = held_put
        queued, submit = [], store.pool.try_submit_save
        store.pool.try_submit_save = lambda nbytes, fn: queued.append(nbytes) or submit(nbytes, fn)
        try:
            assert load(store, keys)[0] == [True] * 3
            assert entered.acquire(timeout=30)
            assert load(store, keys)[0] == [True] * 3  # the disk does not hold them yet: shared again
            for _ in queued[1:]:  # each further copy queued reaches the disk (a free worker runs it)
                assert entered.acquire(timeout=30)
        finally:
            writes.set()
        store.flush()
        assert sorted(written) == sorted(store.tier("disk").ns + k for k in keys)


def test_a_copy_up_the_closing_store_refused_is_not_counted_as_a_dropped_save(tmp_path):
    keys = keys_for(2)
    tiers = shared_tier(tmp_path, keys)
    store = make_store(tmp_path, tiers=tiers)
    reached, go = threading.Event(), threading.Event()
    copy_up = store.loader.reader._copy_up

    def held_copy_up(*args):
        reached.set()
        go.wait(30)  # the store closes meanwhile
        return copy_up(*args)

    store.loader.reader._copy_up = held_copy_up
    restore = threading.Thread(target=lambda: load(store, keys))
    restore.start()
    try:
        assert reached.wait(30)
        store.close()
    finally:
        go.set()
        restore.join(30)
    assert store.metrics.events["copies_up_dropped"] == 2
    assert store.metrics.events.get("saves_dropped", 0) == 0, "every save was stored"
