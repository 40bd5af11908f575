"""The ids an engine passes as started loading (``get_finished``'s ``started_loading_req_ids``):
an id that never gets an async load here is not kept for the life of the process, and no order
an engine legitimately uses (the id before its load's metadata, or a load that starts late) loses
the report of a load."""

from __future__ import annotations

import pytest
import torch

from tests.connector.test_layerwise_loads import _engine_block, _stored, _worker
from tiered_kv.connector.meta import ConnectorMeta, LoadSpec
from tiered_kv.connector.worker import ConnectorWorker

BLOCK_IDS = (3, 9, 4, 11, 0, 7)


@pytest.fixture
def open_worker(tmp_path):
    """Opens the worker over ``tmp_path``'s store (after what the test stored there), closed after."""
    opened: list[ConnectorWorker] = []

    def open_():
        worker, kv = _worker(tmp_path)
        opened.append(worker)
        return worker, kv
    yield open_
    for worker in opened:
        worker.close()
        worker.store.close()


def _step(worker: ConnectorWorker, started=(), loads=()) -> tuple[list[str], list[str]]:
    """One engine step: bind the metadata, start its loads, run nothing, poll."""
    worker.bind_connector_meta(ConnectorMeta(loads=list(loads)))
    worker.start_load_kv()
    worker.wait_for_save()
    result = worker.get_finished([], list(started))
    worker.clear_connector_metadata()
    return result


def _async_load(keys) -> LoadSpec:
    return LoadSpec("r", tuple(keys), BLOCK_IDS, True)


def _start_unpolled(worker: ConnectorWorker, keys) -> None:
    """Bind the metadata of ``r``'s async load and start it (the step's poll comes after)."""
    worker.bind_connector_meta(ConnectorMeta(loads=[_async_load(keys)]))
    worker.start_load_kv()


def _reported_when_done(worker: ConnectorWorker, kv, keys, payloads) -> None:
    """The async load of ``r`` is reported loaded once done, its blocks in the engine's buffer."""
    worker._async_loads["r"].plan.wait()  # (read from the store; copied in at the next poll)
    assert _step(worker) == ([], ["r"])
    assert worker.get_block_ids_with_load_errors() == set()
    for b, p in zip(BLOCK_IDS, payloads):
        assert torch.equal(_engine_block(kv, b), p)
    assert "r" not in worker.started_loading and not worker._async_loads
    assert worker.store.host.stats().extra["leased"] == 0


def test_regression_started_loading_ids_that_never_get_a_load_were_kept_for_the_life_of_the_process(open_worker):
    # aborted requests, loads planned with no blocks, ids of requests another connector loads:
    # every id stayed in started_loading for good, one more per such request
    worker, _ = open_worker()
    for i in range(2000):
        assert _step(worker, started=[f"aborted-{i}"]) == ([], [])
        assert len(worker.started_loading) <= 2


def test_an_id_passed_one_step_before_its_loads_metadata_is_still_reported_loaded(tmp_path, open_worker):
    # TensorRT-LLM's order: the id in a get_finished before the start_load_kv that starts its load
    keys, payloads = _stored(tmp_path)
    worker, kv = open_worker()
    assert _step(worker, started=["r"]) == ([], [])
    _start_unpolled(worker, keys)
    _reported_when_done(worker, kv, keys, payloads)


def test_an_id_passed_in_the_step_its_load_starts_is_reported_loaded(tmp_path, open_worker):
    # vLLM's order and ours: the metadata's load starts, then the id arrives in that step's poll
    keys, payloads = _stored(tmp_path)
    worker, kv = open_worker()
    worker.bind_connector_meta(ConnectorMeta(loads=[_async_load(keys)]))
    worker.start_load_kv()
    worker._async_loads["r"].plan.wait()
    assert worker.get_finished([], ["r"]) == ([], ["r"])
    for b, p in zip(BLOCK_IDS, payloads):
        assert torch.equal(_engine_block(kv, b), p)


def test_a_load_that_starts_after_its_id_was_dropped_is_still_reported_loaded(tmp_path, open_worker):
    # the engine waits for every id it passed: a load arriving late must not finish unreported
    # (its request would wait for ever and its lease be held for good)
    keys, payloads = _stored(tmp_path)
    worker, kv = open_worker()
    assert _step(worker, started=["r"]) == ([], [])
    for _ in range(5):
        assert _step(worker) == ([], [])
    assert "r" not in worker.started_loading  # dropped: no load came for it
    _start_unpolled(worker, keys)
    _reported_when_done(worker, kv, keys, payloads)


def test_an_id_whose_load_is_in_flight_is_kept_however_many_steps_it_takes(tmp_path, open_worker):
    # steps that start no poll in between (the load still running for all the worker knows)
    keys, payloads = _stored(tmp_path)
    worker, kv = open_worker()
    assert worker.get_finished([], ["r"]) == ([], [])
    worker.bind_connector_meta(ConnectorMeta(loads=[_async_load(keys)]))
    worker.start_load_kv()
    for _ in range(5):
        worker.bind_connector_meta(ConnectorMeta())
        worker.start_load_kv()
    assert "r" in worker.started_loading
    _reported_when_done(worker, kv, keys, payloads)
