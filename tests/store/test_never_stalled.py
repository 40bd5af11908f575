"""The forward pass and the scheduler never wait on disk or Redis: loads over the budget queue,
scheduler lookups answer within a deadline while Redis hangs, and the tier recovers by itself."""

from __future__ import annotations

import signal
import threading
import time

import redis
import torch

from tests.store.helpers import NS, keys_for, load_staged, make_store, payloads
from tiered_kv.config import TieredKVConfig
from tiered_kv.store.lower_index import LowerTierIndex
from tiered_kv.store.transfer import TransferPool


def test_a_load_over_the_load_budget_is_queued_and_start_load_kv_does_not_wait_for_it():
    pool = TransferPool(workers=1, max_save_bytes=1 << 20, max_load_bytes=1 << 20)
    gate = threading.Event()
    first = pool.submit_load(1 << 20, gate.wait)  # holds the whole budget until released
    submitted: dict = {}

    def submit() -> None:  # the budget comes back only once the gate opens, after this returns
        submitted["second"] = pool.submit_load(1 << 20, lambda: "second")  # over the budget
        submitted["third"] = pool.submit_load(10, lambda: "third")  # small, but it keeps its place in line

    caller = threading.Thread(target=submit)
    caller.start()
    caller.join(10)
    assert not caller.is_alive(), "submitting a load waited for the budget"
    second, third = submitted["second"], submitted["third"]
    # both wait in line (a state, not a pause): only the budget coming back takes them out of it
    assert [item[2] for item in pool._waiting_loads] == [second, third]
    assert not second.done() and not third.done()
    assert pool.queued_bytes()["load"] == (2 << 20) + 10
    gate.set()
    assert first.result(5) is True and second.result(5) == "second" and third.result(5) == "third"
    assert pool.drain(5) and pool.queued_bytes()["load"] == 0
    pool.close()


def test_loads_waiting_for_budget_fail_cleanly_when_the_pool_closes():
    pool = TransferPool(workers=1, max_save_bytes=1 << 20, max_load_bytes=100)
    gate = threading.Event()
    pool.submit_load(100, gate.wait)
    waiting = pool.submit_load(100, lambda: None)
    threading.Timer(0.1, gate.set).start()
    pool.close()
    assert isinstance(waiting.exception(5), RuntimeError)



def test_a_load_queued_while_every_worker_runs_a_save_runs_beside_them_and_saves_stay_on_the_workers():
    pool = TransferPool(workers=1, max_save_bytes=1 << 20, max_load_bytes=1 << 20)
    stuck, running = threading.Event(), threading.Event()
    first = pool.try_submit_save(10, lambda: running.set() or stuck.wait(30))
    assert running.wait(10)  # the only worker is held by a save
    second = pool.try_submit_save(10, lambda: "second save")
    loads = [pool.submit_load(10, lambda i=i: f"load {i}") for i in range(3)]
    assert [f.result(10) for f in loads] == ["load 0", "load 1", "load 2"]
    assert not second.done(), "a save ran off the workers"
    stuck.set()
    assert first.result(10) is True and second.result(10) == "second save"
    assert pool.drain(10) and pool.queued_bytes() == {"save": 0, "load": 0}
    pool.close()



def test_regression_a_load_queued_as_the_stand_in_ended_waited_behind_the_hung_save():
    """The stand-in found no load left and ended a moment later: a load queued in between saw
    it still running, started none, and waited behind the hung save. Ending is now decided under
    the lock that queueing a load takes."""
    import queue

    pool = TransferPool(workers=1, max_save_bytes=1 << 20, max_load_bytes=1 << 20)
    stuck, running = threading.Event(), threading.Event()
    pool.try_submit_save(10, lambda: running.set() or stuck.wait(30))
    assert running.wait(10)
    real, in_gap, go = pool._queue, threading.Event(), threading.Event()

    class Paused:  # the stand-in pauses once, right after it found the queue empty
        def __getattr__(self, name):
            return getattr(real, name)

        def get_nowait(self):
            try:
                return real.get_nowait()
            except queue.Empty:
                if threading.current_thread().name == "tiered-kv-load" and not in_gap.is_set():
                    in_gap.set()
                    go.wait(10)
                raise

    pool._queue = Paused()
    try:
        assert pool.submit_load(10, lambda: "a").result(10) == "a"
        assert in_gap.wait(10)  # no load left: the stand-in is about to end
        second: dict = {}
        engine = threading.Thread(target=lambda: second.update(b=pool.submit_load(10, lambda: "b")))
        engine.start()
        go.set()
        engine.join(10)
        assert second["b"].result(10) == "b"  # while the save still hangs
    finally:
        stuck.set()
        pool.close()



def test_regression_a_load_queued_as_a_worker_took_a_hung_save_got_no_stand_in():
    """A worker took a save off the queue and counted itself saving only later: a load queued in
    between saw a free worker, got no stand-in, and waited behind the save once it hung."""
    pool = TransferPool(workers=1, max_save_bytes=1 << 20, max_load_bytes=1 << 20)
    real, taken, go, stuck = pool._queue, threading.Event(), threading.Event(), threading.Event()

    class Paused:  # the worker pauses once, right after it took a save
        def __getattr__(self, name):
            return getattr(real, name)

        def get(self, *args, **kwargs):
            job = real.get(*args, **kwargs)
            if job[0] == 1 and not taken.is_set():  # (SAVE)
                taken.set()
                go.wait(10)
            return job

    pool._queue = Paused()
    pool.submit_load(10, lambda: None).result(10)  # the worker waits in the wrapped get now
    try:
        pool.try_submit_save(10, lambda: stuck.wait(30))
        assert taken.wait(10)
        load = pool.submit_load(10, lambda: "load")  # the worker is not counted saving yet
        go.set()
        assert load.result(10) == "load"  # while the save hangs
    finally:
        go.set()
        stuck.set()
        pool.close()


def _hung(server) -> bool:
    """Whether ``server`` really does not answer (a PING of its own gets no reply)."""
    probe = redis.Redis.from_url(server.url, socket_timeout=0.5, socket_connect_timeout=5)
    try:
        probe.ping()
        return False
    except redis.TimeoutError:
        return True
    finally:
        probe.close()


def _returned(fn, hang_guard: float = 20.0):
    """``fn()`` on a thread of its own: its result, or None if it is still running after the
    hang guard (far below the Redis timeout of these tests, far above their lookup deadline)."""
    out: list = []
    caller = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    caller.start()
    caller.join(hang_guard)
    return out[0] if out else None


# Redis's own timeout here (60 s) outlasts every hang guard: a lookup that waited on the hung
# Redis at all could not return while it hangs. The lookup deadline is 50 ms.
HUNG_REDIS = {"timeout": "60s", "retries": 2}


def test_hung_redis_costs_each_scheduler_lookup_at_most_the_deadline_and_recovers_on_its_own(own_redis):
    cfg = TieredKVConfig.from_dict({"remote": {"url": own_redis.url, **HUNG_REDIS}, "lookup_timeout": "50ms"})
    keys = keys_for(4)
    with make_store(None, remote_url=own_redis.url) as writer:
        writer.save(keys, payloads(writer, 4))
        writer.flush()
    index = LowerTierIndex(cfg, NS)
    try:
        assert index.lookup(keys) == 4
        gate = index.presence.gates["remote"]
        own_redis.proc.send_signal(signal.SIGSTOP)  # black-holed: connects, never answers
        try:
            # landed code: every lookup waited on Redis (1 s x 3 tries each, here 60 s x 3)
            found = _returned(lambda: [index.lookup(keys) for _ in range(20)])
            assert found == [0] * 20, "a lookup waited on the hung Redis"  # unanswered: misses
            assert gate._late is not None and not gate._late.done(), "the lookup's Redis call ended"
            assert _hung(own_redis), "Redis answered: nothing here was hung"
        finally:
            own_redis.proc.send_signal(signal.SIGCONT)
        assert gate.timeouts == 20  # one cut by the deadline, the rest skipped at once
        assert index.misses["lookup_timeout"] > 0
        deadline = time.monotonic() + 15  # (a hang guard only)
        while index.lookup(keys) != 4:  # the late answer comes in; the tier is asked again
            assert time.monotonic() < deadline, "the remote tier never came back"
            time.sleep(0.1)
    finally:
        index.close()


def test_hung_redis_bounds_the_stores_own_lookup_too(own_redis):
    keys = keys_for(4)
    with make_store(None, remote_url=own_redis.url, lookup_timeout="50ms",
                    remote={"url": own_redis.url, **HUNG_REDIS}) as store:
        store.save(keys, payloads(store, 4))
        store.flush()
        host_only = keys_for(2, first_token=10_000)
        gate = store.presence.gates["remote"]
        own_redis.proc.send_signal(signal.SIGSTOP)
        try:
            found = _returned(lambda: (store.lookup(keys), store.lookup(host_only)))
            # the host tier still answers for itself; the hung Redis costs a miss, not a wait
            assert found == (4, 0), "the store's lookup waited on the hung Redis"
            assert gate._late is not None and not gate._late.done(), "the lookup's Redis call ended"
            assert _hung(own_redis), "Redis answered: nothing here was hung"
        finally:
            own_redis.proc.send_signal(signal.SIGCONT)
        assert store.metrics.misses("lookup_timeout") >= 1


def test_a_lookup_cut_by_its_deadline_keeps_the_leading_blocks_the_tier_answered(tmp_path):
    """A restart with a cold page cache reads LMDB's index from disk: a long prompt's lookup may
    outlast the deadline. What the tier answered in time is kept (a leading run of blocks),
    instead of the whole prompt being recomputed."""
    keys = keys_for(1024)
    with make_store(tmp_path) as store:
        store.save(keys, payloads(store, 1024))
        store.flush()
    with make_store(tmp_path, lookup_timeout=0.3) as store:
        disk = store.tier("disk").backend
        real, calls, disk_answers = disk.contains_many, [], threading.Event()

        def cold_disk(storage_keys):  # the first part is in the page cache, the rest on a disk
            calls.append(len(storage_keys))  # that answers only once the lookup has returned
            if len(calls) > 1:
                disk_answers.wait(30)
            return real(storage_keys)

        disk.contains_many = cold_disk
        asked = threading.Thread(target=lambda: calls.append(("found", store.lookup(keys))))
        asked.start()
        asked.join(10)  # a lookup waiting for the disk would wait until the 30 s gate gives way
        assert not asked.is_alive(), "the lookup outlasted its deadline"
        found = calls.pop()[1]
        assert 0 < found < 1024 and found == sum(calls[:1]), "the leading answered part was dropped"
        assert store.metrics.misses("lookup_timeout") > 0
        late = store.presence.gates["disk"]._late  # the helper's call, cut by the deadline
        assert late is not None and not late.done()
        disk_answers.set()
        late.result(10)  # the part running at the deadline has ended, and the helper with it
        assert len(calls) == 2, "a part after the deadline was still asked"


def test_regression_a_cancelled_load_kept_counting_in_queued_bytes_until_a_busy_worker_dequeued_it():
    pool = TransferPool(workers=1, max_save_bytes=1 << 20, max_load_bytes=1 << 20)
    gate = threading.Event()
    busy = pool.submit_save(10, gate.wait)  # the one worker is taken
    queued = pool.submit_load(1 << 20, lambda: "never")  # within the budget: queued for a worker
    waiting = pool.submit_load(10, lambda: "waits")  # over the budget: waits in line
    assert pool.queued_bytes() == {"save": 10, "load": (1 << 20) + 10}
    assert queued.cancel()  # given back at once, while the worker is still busy
    assert pool.queued_bytes() == {"save": 10, "load": 10}
    assert waiting.cancel()  # a load waiting for the budget leaves the line
    assert pool.queued_bytes() == {"save": 10, "load": 0} and pool.jobs == 1
    gate.set()
    assert busy.result(5) is True and pool.drain(5)
    assert pool.queued_bytes() == {"save": 0, "load": 0} and pool.jobs == 0
    assert queued.cancelled() and waiting.cancelled()
    pool.close()


def test_a_cancelled_load_waiting_for_the_budget_lets_the_loads_behind_it_start():
    pool = TransferPool(workers=1, max_save_bytes=1 << 20, max_load_bytes=100)
    gate = threading.Event()
    first = pool.submit_load(60, gate.wait)
    big = pool.submit_load(60, lambda: "big")  # over the budget: waits
    small = pool.submit_load(30, lambda: "small")  # fits, but keeps its place behind big
    assert not small.done() and pool.queued_bytes()["load"] == 150
    assert big.cancel()  # small is admitted now, behind the running first
    assert pool.queued_bytes()["load"] == 90
    gate.set()
    assert first.result(5) is True and small.result(5) == "small" and pool.drain(5)
    assert pool.queued_bytes()["load"] == 0 and pool.jobs == 0
    pool.close()


def test_a_load_cancelled_while_the_pool_closes_is_counted_once():
    pool = TransferPool(workers=1, max_save_bytes=1 << 20, max_load_bytes=100)
    gate = threading.Event()
    running = pool.submit_load(100, gate.wait)
    waiting = [pool.submit_load(100, lambda: None) for _ in range(3)]
    assert waiting[1].cancel()
    threading.Timer(0.05, gate.set).start()
    pool.close()
    assert running.result(5) is True
    assert waiting[1].cancelled()
    assert all(isinstance(w.exception(5), RuntimeError) for w in (waiting[0], waiting[2]))
    assert pool.jobs == 0 and pool.queued_bytes() == {"save": 0, "load": 0}


def test_regression_a_layer_wise_load_waited_until_the_step_ended_on_another_plans_failed_block(
        tmp_path, monkeypatch):
    """Two layer-wise loads of one step share a block (two requests with a common prefix) and
    the block is bad: the first keeps its failed reservation until it is released (frames may
    still be copied out of it), which the connector does when the step ends, after the forward
    pass waited on the second load. The second must not wait for that release."""
    from concurrent.futures import TimeoutError as FutureTimeout

    from tiered_kv.store import loading

    monkeypatch.setattr(loading, "PROMOTION_WAIT_S", 60.0)  # would the second wait for the release?
    with make_store(tmp_path, workers=1) as store:
        keys = keys_for(2)
        store.save(keys, payloads(store, 2))
        store.flush(10)
        store.host.delete_many(keys)  # both come from the disk tier
        disk = store.tier("disk")
        assert disk.backend.put_many([(disk.ns + keys[1], b"\0" * 4096)]) == [True]  # keys[1] lies
        first = store.loader.load(store.prepare_load(keys), layered=True)
        second = store.loader.load(store.prepare_load(keys[1:]), layered=True)
        first.wait(10)
        assert first.reasons[1] == "corrupt" and keys[1] in first.deferred
        try:
            second.wait(10)  # no load of it can succeed: a miss at once
            held_up = False
        except FutureTimeout:
            held_up = True
        store.release(first)
        second.wait(10)
        store.release(second)
        assert not held_up, "the second load was held until the first was released"
        assert second.ok == [False] and second.reasons == ["promotion_failed"]
        assert second.progress is not None and second.progress.over == [True]
        assert store.metrics.tiers["host"].misses["no_room"] == 0
        assert not store.host.reserved(keys[1]), "the failed reservation ended with its plan"


def test_regression_a_load_through_the_host_slots_waited_behind_saves_stuck_on_a_hung_disk(tmp_path):
    """Write-behind jobs stuck on a hung tier (a stalled network disk, another process holding
    LMDB's writer lock) held every worker; an engine's load through the host slots (a pool job)
    waited behind them for as long as the tier hung, and a synchronous load's forward pass with it."""
    stored = keys_for(4)
    with make_store(tmp_path, host="64MiB") as earlier:  # blocks on disk from an earlier run
        earlier.save(stored, payloads(earlier, 4)).result(30)
    with make_store(tmp_path, host="64MiB", workers=2) as store:
        disk, hung, inside = store.tier("disk").backend, threading.Event(), threading.Semaphore(0)
        put_many = disk.put_many

        def stuck(items, **kwargs):
            inside.release()
            hung.wait(60)
            return put_many(items, **kwargs)

        disk.put_many = stuck
        try:
            store.save(keys_for(2, first_token=7_000), payloads(store, 2))
            store.save(keys_for(2, first_token=9_000), payloads(store, 2))
            assert inside.acquire(timeout=30) and inside.acquire(timeout=30)  # both workers are stuck
            loaded: list = []
            engine = threading.Thread(target=lambda: loaded.append(load_staged(store, stored)))
            engine.start()
            engine.join(10)
            assert not engine.is_alive(), "the load waited behind the saves stuck on the hung disk"
            ok, outs = loaded[0]
            assert ok == [True] * 4
            assert all(torch.equal(o, p) for o, p in zip(outs, payloads(store, 4)))
        finally:
            hung.set()


def test_regression_a_hung_redis_held_the_stores_start_up_for_its_timeout_times_its_tries(own_redis):
    # the store read its restore estimates from the namespace record on the caller's thread at
    # start-up: with Redis hung, an engine's start waited Redis's timeout x tries (here 60 s x 3)
    with make_store(None, remote_url=own_redis.url) as writer:  # (a namespace record in Redis)
        writer.save(keys_for(4), payloads(writer, 4))
        writer.flush()
    own_redis.proc.send_signal(signal.SIGSTOP)
    try:
        opened = _returned(lambda: make_store(None, remote_url=own_redis.url, lookup_timeout="50ms",
                                              remote={"url": own_redis.url, **HUNG_REDIS}))
        assert opened is not None, "the store's start-up waited on the hung Redis"
        try:
            assert not opened.cost_record.loaded.is_set(), "the estimates' read ended: Redis was not hung"
            assert opened.cost_record.save() is False  # (nothing written over a record not read yet)
            assert _hung(own_redis), "Redis answered: nothing here was hung"
        finally:
            own_redis.proc.send_signal(signal.SIGCONT)
            opened.close()
    finally:
        own_redis.proc.send_signal(signal.SIGCONT)


def test_regression_estimates_read_late_at_start_up_wiped_what_the_store_observed_meanwhile(own_redis):
    # the start-up read that answered after its wait replaced every estimate the store had
    # observed since (and marked them written, so they were never saved)
    with make_store(None, remote_url=own_redis.url) as writer:
        writer.save(keys_for(4), payloads(writer, 4))
        writer.flush()
        for _ in range(5):
            writer.costs.observe_restore("remote", 1 << 20, 0.5)  # the record's: slow restores
        assert writer.cost_record.save()
    own_redis.proc.send_signal(signal.SIGSTOP)
    try:
        store = _returned(lambda: make_store(None, remote_url=own_redis.url, lookup_timeout="50ms",
                                             remote={"url": own_redis.url, **HUNG_REDIS}))
        assert store is not None and not store.cost_record.loaded.is_set()
        for _ in range(50):
            store.costs.observe_restore("remote", 1 << 20, 0.001)  # seen since start: fast
        seen = store.costs.snapshot()
    finally:
        own_redis.proc.send_signal(signal.SIGCONT)
    try:
        assert store.cost_record.loaded.wait(20), "the start-up read never ended"
        assert store.costs.snapshot() == seen  # (the landed code: the record's five slow ones)
        assert store.cost_record.save()  # and they are written over the record's entry
    finally:
        store.close()
