"""A store closing while saves and loads are being queued: every job the pool accepted runs
(or is refused and counted); none waits behind the workers' stop signals for good.

The close is forced into the instant between a job's acceptance and its queueing, wherever that
instant is not inside the pool's lock (where a close cannot run).
"""

from __future__ import annotations

import threading

import pytest

from tests.store.helpers import keys_for, make_store, payloads
from tiered_kv.store.transfer import TransferPool


def _close_at_first_queueing(pool: TransferPool, owner, name: str, job_of, close) -> list[bool]:
    """Make ``owner.<name>`` (a step of queueing a job of ``pool``; ``job_of(args)`` its job)
    run ``close`` to its end, on another thread, the first time it is called for a job outside
    the pool's lock; whether it did, in the list returned."""
    real = getattr(owner, name)
    closed: list[bool] = []

    def hooked(*args, **kwargs):
        if job_of(args) is not None and not closed:  # (a stop signal carries no job)
            closed.append(not pool._cond._is_owned())
            if closed[0]:  # a close could run here: let it, whole
                closer = threading.Thread(target=close)
                closer.start()
                closer.join()
        return real(*args, **kwargs)

    setattr(owner, name, hooked)
    return closed


def test_regression_a_write_behind_accepted_while_the_store_closed_never_ran_and_its_save_never_completed(
        tmp_path):
    # the worker commits a save as the engine shuts the store down on another thread: the pool
    # accepted the write-behind (checked open, took its bytes), the close drained an empty pool and
    # stopped the workers, then the job was queued behind their stop signals: the blocks reported
    # stored were never written nor counted, and the save's future never completed
    store = make_store(tmp_path)
    keys = keys_for(4)
    blocks = payloads(store, 4)
    closed = _close_at_first_queueing(store.pool, store.pool, "_put", lambda a: a[2], store.close)
    done = store.save(keys, blocks)
    store.close()  # (the engine's close, when the hook found no instant to close in)
    assert done is not None and done.done(), "the save's future never completes"
    assert done.exception() is None and store.metrics.events.get("saves_dropped", 0) == 0
    with make_store(tmp_path) as again:
        assert again.lookup(keys) == 4  # written behind before the close ended
    assert closed == [False]  # (the job is queued in the section that saw the pool open)


@pytest.mark.parametrize("kind", ["save", "load"])
def test_regression_a_job_the_pool_accepted_as_it_closed_was_never_run(kind):
    pool = TransferPool(workers=2, max_save_bytes=1 << 20, max_load_bytes=1 << 20)
    closed = _close_at_first_queueing(pool, pool._queue, "put", lambda a: a[0][2], pool.close)
    ran = threading.Event()
    submit = pool.try_submit_save if kind == "save" else pool.submit_load
    fut = submit(10, ran.set)
    pool.close()
    assert fut is not None and fut.done() and ran.is_set(), "accepted, never run"
    assert pool.jobs == 0 and pool.queued_bytes() == {"save": 0, "load": 0}
    assert closed == [False]  # (the job is queued in the section that saw the pool open)
