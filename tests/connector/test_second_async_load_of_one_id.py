"""A second async load under a request id whose first one is still in flight or not reported yet
(an engine that lets a client reuse an id at once after aborting its request): the first load's
lease and host slots are released, never scattered into its blocks, and the engine gets the one
report it waits for, once the second load's blocks are in its buffer."""

from __future__ import annotations

import pytest
import torch

from tests.connector.test_layerwise_loads import _engine_block, _stored, _worker
from tiered_kv.connector.meta import ConnectorMeta, LoadSpec

FIRST_BLOCKS = (3, 9, 4)
SECOND_BLOCKS = (12, 13, 14, 15, 8, 10)


def _start(worker, *loads: LoadSpec) -> None:
    """One engine step that starts ``loads`` (the poll comes after)."""
    worker.bind_connector_meta(ConnectorMeta(loads=list(loads)))
    worker.start_load_kv()
    worker.wait_for_save()
    worker.clear_connector_metadata()


@pytest.mark.parametrize("first_done", [False, True], ids=["first-in-flight", "first-done-unreported"])
def test_regression_a_second_async_load_under_one_id_leaked_the_first_loads_lease_for_good(tmp_path, first_done):
    keys, payloads = _stored(tmp_path)
    worker, kv = _worker(tmp_path)
    try:
        _start(worker, LoadSpec("r", tuple(keys[:3]), FIRST_BLOCKS, True))
        if first_done:
            worker._async_loads["r"].plan.wait()
        _start(worker, LoadSpec("r", tuple(keys), SECOND_BLOCKS, True))
        worker._async_loads["r"].plan.wait()
        assert worker.get_finished([], ["r"]) == ([], ["r"])  # one report, for the second load
        assert worker.get_block_ids_with_load_errors() == set()
        for b, p in zip(SECOND_BLOCKS, payloads):
            assert torch.equal(_engine_block(kv, b), p)
        for b in FIRST_BLOCKS:  # the first load is dropped, never copied into its blocks
            assert not _engine_block(kv, b).any()
        assert worker.store.host.stats().extra["leased"] == 0
        assert worker.store.metrics.snapshot()["events"]["async_loads_replaced"] == 1
        _start(worker)
        assert worker.get_finished([], ["r"]) == ([], [])  # nothing more reported for the id
    finally:
        worker.close()
        assert worker.store.host.stats().extra["leased"] == 0
        worker.store.close()
