"""A store closing while a load is being started: every block of the load has exactly one
outcome (a hit of the tier that served it, or a counted miss), whatever instant the close takes.
The close is forced into the instant between two of the load's jobs being queued."""

from __future__ import annotations

import threading

import pytest

from tests.store.helpers import keys_for, make_store, payloads
from tiered_kv.connector.load_starts import start_load
from tiered_kv.connector.meta import LoadSpec


@pytest.mark.parametrize("layered", [False, True], ids=["whole", "layer_wise"])
def test_regression_a_load_the_store_closed_between_two_of_its_jobs_counted_its_queued_blocks_twice(
        tmp_path, layered):
    """The first job of a load was queued, then the engine closed the store on another thread,
    then the second job was refused: the loader raised, the worker counted every block of the load
    a ``store_closed`` miss, and the host hit and the blocks the queued job read were hits too.
    Every block of a load is one outcome: the blocks left are the plan's ``store_closed`` misses."""
    store = make_store(tmp_path)  # two workers: the four disk blocks are two jobs
    keys = keys_for(5)
    store.save(keys, payloads(store, 5))
    assert store.flush(10)
    store.host.delete_many(keys[1:])  # keys[0] is a host hit
    submit, queued = store.pool.submit_load, []

    def queue_then_the_engine_closes(nbytes, fn):
        job = submit(nbytes, fn)
        if not queued:
            closer = threading.Thread(target=store.close)
            closer.start()
            closer.join(60)
            assert not closer.is_alive(), "close() hung behind a load"
        queued.append(job)
        return job

    store.pool.submit_load = queue_then_the_engine_closes
    plan = start_load(store, LoadSpec("r1", tuple(keys), tuple(range(5)), False), layered=layered)
    plan.wait(10)
    assert plan.progress is None or plan.progress.wait_all(10), "a block of the load never ended"
    store.release(plan)
    tiers = store.metrics.snapshot()["tiers"]
    outcomes = sum(t["hits"] + sum(t["misses"].values()) for t in tiers.values())
    assert outcomes == len(keys), tiers
    assert plan.reasons == [None, None, None, "store_closed", "store_closed"]
    assert tiers["host"] == {**tiers["host"], "hits": 1, "misses": {"store_closed": 2}}
    assert tiers["disk"]["hits"] == 2
