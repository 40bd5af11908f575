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


def hang_puts(store, *names: str) -> threading.Event:
    """The block writes into the tiers ``names`` hang until the event returned is set."""
    answers = threading.Event()
    for name in names:
        backend = store.tier(name).backend
        put_many = backend.put_many
        backend.put_many = lambda items, put=put_many, **kw: (not blocks_in(items) or answers.wait(60)) and put(items, **kw)
    return answers


def test_two_restores_at_once_past_the_budget_start_one_copy_into_a_hung_tier_not_two(tmp_path, monkeypatch):
    """Whether a copy past the budget into a tier was still running was checked apart from
    starting one: a restore that came while another's copy was being waited for (not yet known
    late) started a second thread into the same hung tier."""
    from tiered_kv.store import copies_up

    second, third = keys_for(1, first_token=5_000), keys_for(1, first_token=9_000)
    tiers = shared_tier(tmp_path, second, third)
    with make_store(tmp_path, tiers=tiers) as store:
        answers, budget = hang_puts(store, "disk"), threading.Event()
        store.pool.try_submit_save(store.config.max_inflight_save, lambda: budget.wait(60))  # the budget is spent
        real_wait, waiting, go = copies_up.wait, threading.Event(), threading.Event()

        def first_wait_held(fs, timeout):  # the first restore waits for its copy until told
            if not waiting.is_set():
                waiting.set()
                go.wait(60)
            return real_wait(fs, 0)

        monkeypatch.setattr(copies_up, "wait", first_wait_held)
        restored: dict = {}
        first_restore = threading.Thread(target=lambda: restored.update(second=load(store, second)[0]))
        first_restore.start()
        try:
            assert waiting.wait(30)  # its copy runs (hung), and is being waited for
            assert load(store, third)[0] == [True]
            assert store.metrics.events.get("copies_up_dropped", 0) == 1, "a second copy into the hung tier started"
        finally:
            go.set()
            first_restore.join(30)
            answers.set()
            budget.set()
        assert restored == {"second": [True]}
        assert store.flush(30)
        assert store.tier("disk").contains(second + third) == [True, False]


def test_a_restore_below_two_hung_tiers_waits_for_its_copies_up_once_not_once_per_tier(tmp_path, monkeypatch):
    from tiered_kv.store import copies_up

    keys = keys_for(1)
    tiers = [{"name": "mid", "url": f"file://{tmp_path}/mid"}] + shared_tier(tmp_path, keys)
    with make_store(tmp_path, tiers=tiers) as store:
        answers, budget = hang_puts(store, "disk", "mid"), threading.Event()
        store.pool.try_submit_save(store.config.max_inflight_save, lambda: budget.wait(60))
        clock, waits, real_wait = [0.0], [], copies_up.wait

        def waited_out(fs, timeout):  # each wait runs out (both tiers hang), on a clock of the test's
            waits.append(timeout)
            clock[0] += timeout
            return real_wait(fs, 0)

        monkeypatch.setattr(copies_up, "wait", waited_out)
        monkeypatch.setattr(copies_up, "_now", lambda: clock[0], raising=False)
        try:
            assert load(store, keys)[0] == [True]
            assert len(waits) == 2  # a copy into each tier above, each on its own thread
            assert sum(waits) <= copies_up.COPY_WAIT_S, f"the restore waited {waits} for its copies up"
        finally:
            answers.set()
            budget.set()
        assert store.flush(30)
        assert store.tier("disk").contains(keys) == [True] and store.tier("mid").contains(keys) == [True]


def test_a_flush_does_not_report_done_while_a_late_copy_up_is_still_to_be_written(tmp_path, monkeypatch):
    """A copy past the budget runs on a thread of its own, outside the pool flush drained: flush
    returned True with it still to be written, and a close after that flush lost it."""
    from tiered_kv.store import copies_up

    keys = keys_for(1)
    tiers = shared_tier(tmp_path, keys)
    store = make_store(tmp_path, tiers=tiers)
    try:
        answers, budget = hang_puts(store, "disk"), threading.Event()
        store.pool.try_submit_save(store.config.max_inflight_save, lambda: budget.wait(60))
        real_wait = copies_up.wait
        monkeypatch.setattr(copies_up, "wait", lambda fs, timeout: real_wait(fs, 0))  # late at once
        assert load(store, keys)[0] == [True]
        budget.set()
        assert store.pool.drain(30)  # the pool is idle; the late copy into the disk still hangs
        assert store.flush(0) is False, "flush reported every write done with a late copy up running"
        answers.set()
        assert store.flush(30) is True
        assert store.tier("disk").contains(keys) == [True]
    finally:
        answers.set()
        budget.set()
        store.close()


def test_a_copy_up_whose_thread_cannot_start_is_dropped_not_raised_into_the_restore(tmp_path, monkeypatch):
    """``Thread.start`` raising ("can't start new thread") for a copy past the budget reached the
    engine's load as a RuntimeError, and left the copy a tracked write that never ended (a
    withdrawal of its keys waited for it for ever)."""
    keys = keys_for(2)
    tiers = shared_tier(tmp_path, keys)
    with make_store(tmp_path, tiers=tiers) as store:
        budget = threading.Event()
        store.pool.try_submit_save(store.config.max_inflight_save, lambda: budget.wait(60))
        real_start = threading.Thread.start

        def start(thread: threading.Thread) -> None:
            if thread.name.startswith("tiered-kv-copy-up"):
                raise RuntimeError("can't start new thread")
            real_start(thread)

        monkeypatch.setattr(threading.Thread, "start", start)
        try:
            assert load(store, keys)[0] == [True, True]
            assert store.metrics.events["copies_up_dropped"] == 2
        finally:
            budget.set()
        store.invalidate(keys).result(30)  # no write of theirs left running
        assert store.flush(30)
        assert store.tier("disk").contains(keys) == [False, False]
