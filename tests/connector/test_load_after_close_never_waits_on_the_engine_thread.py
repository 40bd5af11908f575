"""A load the scheduler leased before the store closed starts after the close (an engine stepping
on while it shuts down) while another load's read is still held inside a lower tier that does not
answer. ``start_load_kv`` runs on the engine's thread, before its forward pass: it must return
without waiting for any read, its blocks load errors the engine recomputes (``store_closed``
misses), and nothing it leased is left pinned."""

from __future__ import annotations

import threading
from concurrent.futures import wait as futures_wait

from tests.connector.test_layerwise_loads import _stored, _worker
from tests.connector.test_replaced_async_load_never_stalls_the_engine import (
    HANG_GUARD_S,
    _hold_first_disk_read,
    _step,
)
from tiered_kv.connector.meta import LoadSpec

HELD_BLOCKS, SYNC_BLOCKS, ASYNC_BLOCKS = (3, 9), (4, 5), (6, 7)


def test_a_load_started_after_the_store_closed_returns_while_a_read_is_still_held(tmp_path):
    keys, _ = _stored(tmp_path)
    # the close waits this long for the held read, then gives it up (leaves the disk tier open)
    worker, _kv = _worker(tmp_path, close_timeout=0.2)
    store, disk = worker.store, worker.store.tier("disk").backend
    gate, entered = _hold_first_disk_read(worker)
    returned = threading.Event()
    late = [LoadSpec("sync", tuple(keys[2:4]), SYNC_BLOCKS, False),
            LoadSpec("async", tuple(keys[4:6]), ASYNC_BLOCKS, True)]
    engine = threading.Thread(target=lambda: (_step(worker, *late), returned.set()), daemon=True)
    try:
        _step(worker, LoadSpec("held", tuple(keys[:2]), HELD_BLOCKS, True))
        held = worker._async_loads["held"].plan
        assert entered.wait(HANG_GUARD_S)  # its read is inside the held disk tier
        for spec in late:  # the scheduler half leased them before the close
            store.lease(spec.request_id, spec.keys)
        store.close()  # the engine shuts down; it gives the held read up and returns
        assert store.pool.closed and not gate.is_set() and not held.done()

        engine.start()  # the engine steps once more, starting the leased loads
        assert returned.wait(HANG_GUARD_S), "start_load_kv waited on the engine's thread after the close"
        assert not gate.is_set() and not held.done()  # it returned while the read was still held
        assert worker.get_block_ids_with_load_errors() == set(SYNC_BLOCKS)  # recomputed by the engine
        assert store.metrics.misses("store_closed") == len(SYNC_BLOCKS) + len(ASYNC_BLOCKS)
        assert disk.stats().extra["pinned"] == len(HELD_BLOCKS)  # only the held load's: no lease left

        gate.set()  # the tier answers: the held read ends
        futures_wait(held.futures, HANG_GUARD_S)
        assert worker.get_finished([], ["held", "async"]) == ([], ["async", "held"])
        assert set(ASYNC_BLOCKS) <= worker.get_block_ids_with_load_errors()
        assert held.released  # (what the held read left in the closed host tier is not asserted)
    finally:
        gate.set()
        if engine.ident is not None:  # (started)
            engine.join(HANG_GUARD_S)
        worker.close()
        store.close()
