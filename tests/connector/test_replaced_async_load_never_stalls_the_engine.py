"""A second async load under a request id whose first one is still reading from a lower tier
that does not answer (a stalled network disk, a hung Redis): ``start_load_kv`` runs on the
engine's thread, before its forward pass, so dropping the first load must not wait for that
read. The first load's lease is kept until its read ended (released by a later ``get_finished``,
never leaked) and its blocks are never written into the engine's blocks."""

from __future__ import annotations

import threading
from concurrent.futures import wait as futures_wait

import torch

from tests.connector.test_layerwise_loads import _engine_block, _stored, _worker
from tiered_kv.connector.meta import ConnectorMeta, LoadSpec

HANG_GUARD_S = 30  # generous: only a guard against a hang, no duration is asserted
FIRST_BLOCKS = (3, 9, 4)
SECOND_BLOCKS = (12, 13, 14)


def _hold_first_disk_read(worker) -> tuple[threading.Event, threading.Event]:
    """The disk tier's first block read waits until ``gate`` is set (``entered``: it began);
    later reads answer at once."""
    disk, gate, entered = worker.store.tier("disk").backend, threading.Event(), threading.Event()
    lock, calls = threading.Lock(), [0]

    def held(read):
        def read_held(*args, **kwargs):
            with lock:
                calls[0] += 1
                first = calls[0] == 1
            if first:
                entered.set()
                gate.wait(4 * HANG_GUARD_S)  # (the test sets it; the bound only ends a failed run)
            return read(*args, **kwargs)
        return read_held

    disk.visit_split, disk.visit_ranges = held(disk.visit_split), held(disk.visit_ranges)
    return gate, entered


def _step(worker, *loads: LoadSpec) -> None:
    """One engine step that starts ``loads`` (the poll comes after)."""
    worker.bind_connector_meta(ConnectorMeta(loads=list(loads)))
    worker.start_load_kv()
    worker.wait_for_save()
    worker.clear_connector_metadata()


def test_regression_a_replaced_async_load_stalled_the_engines_thread_on_a_hung_tiers_read(tmp_path):
    keys, payloads = _stored(tmp_path)
    worker, kv = _worker(tmp_path)
    gate, entered = _hold_first_disk_read(worker)
    returned = threading.Event()
    engine = threading.Thread(target=lambda: (_step(worker, LoadSpec("r", tuple(keys[3:]), SECOND_BLOCKS, True)),
                                              returned.set()), daemon=True)
    try:
        _step(worker, LoadSpec("r", tuple(keys[:3]), FIRST_BLOCKS, True))
        first = worker._async_loads["r"].plan
        assert entered.wait(HANG_GUARD_S)  # the first load's read is inside the held disk tier
        engine.start()  # the engine starts a second async load under the same id
        assert returned.wait(HANG_GUARD_S), "start_load_kv waited for the replaced load's held read"
        assert not gate.is_set() and not first.done()  # it returned while the read was still held
        second = worker._async_loads["r"].plan
        second.wait(HANG_GUARD_S)
        assert worker.get_finished([], ["r"]) == ([], ["r"])  # one report, for the second load
        assert worker.get_block_ids_with_load_errors() == set()
        for b, p in zip(SECOND_BLOCKS, payloads[3:]):
            assert torch.equal(_engine_block(kv, b), p)
        assert len(worker._dropped) == 1 and not first.released  # kept while its read runs: no leak

        gate.set()  # the tier answers: the dropped load's read ends
        futures_wait(first.futures, HANG_GUARD_S)
        assert all(f.done() for f in first.futures)
        _step(worker)
        assert worker.get_finished([], ["r"]) == ([], [])  # nothing more reported for the id
        assert first.released and len(worker._dropped) == 0
        assert worker.store.host.stats().extra["leased"] == 0
        for b in FIRST_BLOCKS:  # the dropped load is never copied into its blocks
            assert not _engine_block(kv, b).any()
        assert worker.store.metrics.snapshot()["events"]["async_loads_replaced"] == 1
    finally:
        gate.set()
        if engine.ident is not None:  # (started)
            engine.join(HANG_GUARD_S)
        worker.close()
        assert worker.store.host.stats().extra["leased"] == 0
        worker.store.close()


def test_a_worker_closed_with_a_replaced_load_still_reading_releases_its_lease(tmp_path):
    keys, _ = _stored(tmp_path)
    worker, _kv = _worker(tmp_path)
    gate, entered = _hold_first_disk_read(worker)
    try:
        _step(worker, LoadSpec("r", tuple(keys[:3]), FIRST_BLOCKS, True))
        first = worker._async_loads["r"].plan
        assert entered.wait(HANG_GUARD_S)
        _step(worker, LoadSpec("r", tuple(keys[3:]), SECOND_BLOCKS, True))
        assert len(worker._dropped) == 1
        gate.set()
        worker.close()  # (closing waits for the reads, as for the loads in flight)
        assert first.released and len(worker._dropped) == 0
        assert worker.store.host.stats().extra["leased"] == 0
    finally:
        gate.set()
        worker.close()
        worker.store.close()
