"""A withdrawal (``invalidate``: KV computed over a block that failed to load) races the writes
of the same keys. Whatever interleaving, once the withdrawal is done no tier holds the wrong
block; and a save reported done is written behind. Each scenario forces its interleaving by
running the other side at the exact step where another thread could."""

from __future__ import annotations

import threading
import time

import pytest

from tests.store.helpers import keys_for, load, make_store, payloads
from tiered_kv.errors import BackendUnavailable

WAIT_S = 1.0  # a bound: how long a forced order waits for a step that must not come first


def test_regression_a_write_queued_before_it_was_tracked_landed_after_its_withdrawals_delete(tmp_path):
    with make_store(tmp_path) as store:
        keys = keys_for(1)
        withdrawal = []
        deleted = threading.Event()
        submit = store.pool.try_submit_save

        def queued_then_withdrawn(nbytes, fn):
            fut = submit(nbytes, fn)  # the write-behind job is queued, then the keys are withdrawn
            if not withdrawal:
                withdrawal.append(store.invalidate(keys))
                withdrawal[0].add_done_callback(lambda _f: deleted.set())
            return fut

        disk = store.tier("disk").backend
        put = disk.put_many

        def put_after_the_delete(items, tenant=b""):  # the old order; now the delete waits for it
            deleted.wait(WAIT_S)
            return put(items, tenant=tenant)

        store.pool.try_submit_save, disk.put_many = queued_then_withdrawn, put_after_the_delete
        store.save(keys, payloads(store, 1, seed=1))
        withdrawal[0].result(10)
        store.flush(10)
        assert store.tier("disk").contains(keys) == [False] and store.lookup(keys) == 0


def test_regression_a_write_behind_leased_before_the_withdrawal_was_queued_after_its_delete(tmp_path):
    # the wrong block's write-behind leased its host copy, then the withdrawal came, then the
    # write was queued: it was taken for the recomputed replacement and ordered after the delete
    with make_store(tmp_path) as store:
        keys = keys_for(1)
        submit = store.saver.submit_write
        withdrawals = []

        def withdrawn_first(keys_, *args, **kwargs):
            if not withdrawals:
                withdrawals.append(store.invalidate(keys))
            return submit(keys_, *args, **kwargs)

        store.saver.submit_write = withdrawn_first
        store.save(keys, payloads(store, 1, seed=2))
        withdrawals[0].result(10)
        store.flush(10)
        assert store.tier("disk").contains(keys) == [False] and store.lookup(keys) == 0
        assert store.host.stats().extra["leased"] == 0


@pytest.mark.parametrize("withdrawal", ["begun", "over"])
def test_regression_an_evicted_copy_taken_before_the_withdrawal_landed_after_its_delete(tmp_path, withdrawal):
    # the eviction took k[0]'s bytes, then the withdrawal began before the hook queued their
    # copy ("begun": its delete still in flight) or ran to its end ("over": nothing in flight
    # named k[0] any more when the copy was queued)
    with make_store(tmp_path, host="32KiB", disk={"policy": "on_evict"}) as store:  # 2 host slots
        k = keys_for(3)
        data = payloads(store, 3)
        store.save(k[:1], data[:1])  # the wrong block
        submit = store.saver.submit_write
        withdrawals = []

        def withdrawn_first(keys_, *args, **kwargs):
            if k[0] in keys_ and not withdrawals:
                withdrawals.append(store.invalidate(k[:1]))
                if withdrawal == "over":
                    withdrawals[0].result(10)
            return submit(keys_, *args, **kwargs)

        store.saver.submit_write = withdrawn_first
        store.save(k[1:], data[1:])  # evicts k[0] to the disk tier
        assert withdrawals, "k[0] was not evicted"
        assert withdrawals[0].result(10) == 1
        store.flush(10)
        assert store.tier("disk").contains(k[:1]) == [False] and store.lookup(k[:1]) == 0
        store.save(k[:1], data[:1])  # recomputed after the withdrawal: evicted and written as usual
        store.save(k[1:], data[1:])
        store.flush(10)
        assert store.tier("disk").contains(k[:1]) == [True]


def test_regression_a_block_evicted_between_its_commit_and_its_lease_was_never_written_behind(tmp_path):
    # commit_save published the block, then another thread's reservation evicted it before the
    # write-behind leased it: a save reported done, stored nowhere, nothing counted
    with make_store(tmp_path, host="16KiB") as store:  # one host slot
        k = keys_for(2)
        commit = store.host.commit_many
        others = []

        def another_save_right_after(keys, **kwargs):
            commit(keys, **kwargs)
            if not others:
                others.append(store.prepare_save(k[1:]))  # evicts k[0] unless it is leased
            return None

        store.host.commit_many = another_save_right_after
        store.save(k[:1], payloads(store, 1))
        store.host.commit_many = commit
        store.commit_save(others[0], ok=False)
        store.flush(10)
        assert store.lookup(k[:1]) == 1


def test_the_future_of_a_tracked_write_cannot_be_cancelled_and_leaks_no_lease(tmp_path):
    # cancelling the pool's own future of a write-behind skipped its job: the host copy stayed
    # leased for good (and a withdrawal waiting on it never started its delete)
    with make_store(tmp_path) as store:
        gate, started = threading.Event(), threading.Semaphore(0)
        for _ in range(store.config.workers):
            store.pool.submit_save(1, lambda: (started.release(), gate.wait(30)))
        for _ in range(store.config.workers):
            assert started.acquire(timeout=10)
        fut = store.save(keys_for(1), payloads(store, 1))
        assert fut is not None and not fut.cancel()
        gate.set()
        assert fut.result(10) == 1 and store.flush(10)
        assert store.host.stats().extra["leased"] == 0 and store.lookup(keys_for(1)) == 1


def test_regression_cancelling_a_withdrawals_future_let_the_replacement_run_before_its_delete(tmp_path):
    with make_store(tmp_path) as store:
        keys = keys_for(1)
        store.save(keys, payloads(store, 1, seed=1)).result(10)
        gate, started = threading.Event(), threading.Semaphore(0)
        for _ in range(store.config.workers):  # every worker held: the delete stays queued
            store.pool.submit_save(1, lambda: (started.release(), gate.wait(30)))
        for _ in range(store.config.workers):
            assert started.acquire(timeout=10)
        withdrawal = store.invalidate(keys)
        assert not withdrawal.cancel()  # a cancelled one counted as done: writes after it went first
        replacement = store.save(keys, payloads(store, 1, seed=2))
        gate.set()
        withdrawal.result(10)
        assert replacement is not None and replacement.result(10) == 1 and store.flush(10)
        assert store.tier("disk").contains(keys) == [True]


def test_regression_a_failed_layer_wise_load_of_a_block_dropped_its_evicted_copy(tmp_path):
    # a load that fails is not a withdrawal: the block's evicted bytes, on their way to the
    # on_evict tier, are still good (the scheduler withdraws the keys after a failed block,
    # not the block), and were then written nowhere
    with make_store(tmp_path, host="32KiB", disk={"policy": "on_evict"}) as store:  # 2 host slots
        k = keys_for(3)
        data = payloads(store, 3)
        store.save(k[:1], data[:1])  # the good block, in the host tier only
        store.flush(10)
        hook = store.saver.on_host_evict
        reasons = []

        def a_layer_wise_load_fails_first(key, value, tenant):
            if key == k[0] and not reasons:  # not on disk yet: another request's load misses
                plan = store.loader.load(store.prepare_load(k[:1]), layered=True)
                reasons.extend(plan.wait(10).reasons)
                store.release(plan)
            return hook(key, value, tenant)

        store.saver.on_host_evict = a_layer_wise_load_fails_first
        store.save(k[1:], data[1:])  # evicts k[0]: its hook queues the copy
        store.flush(10)
        assert reasons and reasons[0] is not None, "the layer-wise load did not miss"
        assert store.tier("disk").contains(k[:1]) == [True], "the good block is lost from every tier"


def test_regression_a_withdrawal_whose_delete_redis_refused_left_the_wrong_block_loadable(redis_url):
    # Redis refused the delete (its circuit breaker open after a blip): the withdrawal ended,
    # the keys were no longer suppressed, and the wrong copy loaded as good from Redis, here and
    # in every replica sharing it. Now the key stays withdrawn until a retry deleted it.
    keys = keys_for(1)
    with make_store(None, remote_url=redis_url) as store:
        wrong = payloads(store, 1, seed=3)
        store.save(keys, wrong).result(10)
        assert store.tier("remote").contains(keys) == [True]
        remote = store.tier("remote").backend
        delete, refused = remote.delete_many, []

        def refused_once(names):
            if not refused:
                refused.append(names)
                raise BackendUnavailable(f"redis at {redis_url} is down (next probe in 0.5s)")
            return delete(names)

        remote.delete_many = refused_once
        store.invalidate(keys).result(10)
        assert refused and store.metrics.events.get("remote_invalidate_failed") == 1
        assert store.lookup(keys) == 0, "the wrong block is promised"
        ok, outs = load(store, keys)
        assert ok == [False], "the wrong block was loaded as good"
        deadline = time.monotonic() + 30  # a bound, not a figure: the retry's first wait is 0.5 s
        while store.tier("remote").contains(keys) != [False]:
            assert time.monotonic() < deadline, "the refused delete was never tried again"
            time.sleep(0.05)
        assert len(refused) == 1
    with make_store(None, remote_url=redis_url) as replica:
        assert replica.lookup(keys) == 0


def test_regression_an_untyped_delete_failure_ended_the_withdrawal_and_a_failing_last_retry_left_the_store_open(tmp_path):
    # A medium's delete failing with an error of no BackendError type (redis-py's protocol
    # errors were such) ended the withdrawal unretried, and the wrong block loaded as good; and
    # the last retry at close raising it skipped closing the tiers and the pool.
    keys = keys_for(1)
    store = make_store(tmp_path)
    disk = store.tier("disk").backend
    closed = []
    try:
        store.save(keys, payloads(store, 1, seed=3)).result(10)
        store.flush()
        assert store.tier("disk").contains(keys) == [True]

        def broken(names):
            raise RuntimeError("protocol error: unexpected reply")

        disk.delete_many = broken
        store.invalidate(keys).result(10)
        assert store.metrics.events.get("disk_invalidate_failed") == 1
        assert store.lookup(keys) == 0, "the wrong block is promised"
        assert load(store, keys)[0] == [False], "the wrong block was loaded as good"
        close = disk.close
        disk.close = lambda: (closed.append(True), close())
    finally:
        store.close()  # its last retry fails again: logged, and every part is closed all the same
    assert closed == [True]


def test_regression_locate_named_a_tier_for_a_block_being_withdrawn(tmp_path):
    # lookup and present said absent while a tier's delete was failing, but locate (SGLang's
    # existence checks and its reads) still named the disk: the withdrawn block was promised
    keys = keys_for(1)
    store = make_store(tmp_path)
    try:
        store.save(keys, payloads(store, 1, seed=4)).result(10)
        store.flush()
        assert store.locate(keys) in (["host"], ["disk"])

        def refused(names):
            raise BackendUnavailable("disk refused the delete")

        store.tier("disk").backend.delete_many = refused
        store.invalidate(keys).result(10)
        assert store.lookup(keys) == 0
        assert store.locate(keys) == [None] and store.locate(keys, host=False) == [None]
    finally:
        store.close()
