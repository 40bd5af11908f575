"""The engine steps on after the store was closed (it shuts down with requests in flight, or a
step races the close): nothing raises into it and no forward waits. Every block a load planned
then is a load error the engine recomputes, counted ``store_closed`` and logged once; its saves
are counted drops (``saves_after_close``)."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.store.helpers import NS, keys_for, make_store, payloads
from tiered_kv.connector.meta import ConnectorMeta, LoadSpec, SaveSpec
from tiered_kv.connector.worker import ConnectorWorker


@pytest.mark.parametrize("layerwise", [False, True])
def test_regression_a_step_after_the_store_closed_raised_store_closed_into_the_engine(tmp_path, layerwise, caplog):
    store = make_store(tmp_path, layerwise_loads=layerwise)
    keys = keys_for(4)
    store.save(keys, payloads(store, 4))
    store.flush(10)
    worker = ConnectorWorker(store)
    worker.takes_failed_requests = True  # as vLLM's adapter does
    worker.register_kv_caches(torch.zeros(2, NS.num_layers, 8, NS.block_size, NS.num_kv_heads, NS.head_dim,
                                          dtype=torch.bfloat16))
    assert worker.streams_layers == layerwise
    store.close()  # the engine shuts down; its worker steps twice more
    caplog.set_level(logging.WARNING, logger="tiered_kv.connector.load_starts")
    for _ in range(2):
        worker.bind_connector_meta(ConnectorMeta(
            loads=[LoadSpec("sync", tuple(keys[:2]), (1, 2), False), LoadSpec("async", tuple(keys[2:]), (3, 4), True)],
            saves=[SaveSpec("new", tuple(keys_for(2, first_token=10_000)), (5, 6), 0)]))
        worker.start_load_kv()
        for layer in range(NS.num_layers):
            worker.wait_for_layer_load(layer)
        worker.save_kv_layer()
        worker.wait_for_save()
        assert worker.get_finished(["new"], ["async"]) == (["new"], ["async"])
        assert worker.get_block_ids_with_load_errors() == {1, 2, 3, 4}  # recomputed by the engine
        assert worker.take_failed_requests() == {"async"}
    assert store.metrics.misses("store_closed") == 8
    assert store.metrics.events["saves_after_close"] == 4
    assert len([r for r in caplog.records if "after the store was closed" in r.getMessage()]) == 1
    worker.close()


def test_regression_a_scheduler_lookup_after_the_store_closed_raised_backend_closed(tmp_path):
    # the scheduler half shares the worker's store in one process; an engine still scheduling
    # while it shuts down (the store closed at exit first) got BackendClosed from the host tier
    from tests.connector.test_failed_load_sharing import SHARED, _connector
    from tiered_kv.integrations.common import RequestView

    conn = _connector(tmp_path)
    conn.store.save(keys_for(2), payloads(conn.store, 2))
    conn.store.close()
    request = RequestView("late", SHARED + [3], len(SHARED) + 1, None)
    assert conn.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    conn.scheduler.update_state_after_alloc(request, [10, 11, 12, 13, 14], 0)
    keys = keys_for(2)
    assert conn.store.lookup(keys) == 0 and conn.store.present(keys) == [False, False]
    assert conn.store.locate(keys) == [None, None]
    assert conn.store.stats()["events"]["lookups_after_close"] >= 3
    conn.close()


def test_regression_a_connector_closed_during_an_async_load_left_its_request_waiting_for_good(tmp_path):
    # close() released the loads in flight and forgot them: get_finished never named the
    # request, which the engine kept waiting for its remote KV, step after step
    from tests.connector.engine_helpers import GREEDY, connector, engine, prompt, reference

    prompts = [prompt(300, seed=5)]
    saver = connector(tmp_path / "db")
    engine(saver).generate(prompts, GREEDY)
    saver.close()
    conn = connector(tmp_path / "db", load_async=True)
    eng = engine(conn)
    eng.add_request(prompts[0], GREEDY)
    eng.step()  # the load is in flight
    conn.close()
    outputs = []
    for _ in range(100):
        outputs += eng.step()
        if not eng.has_unfinished_requests():
            break
    assert not eng.has_unfinished_requests(), "the request still waits for its remote KV"
    assert [o.output_token_ids for o in outputs] == reference(prompts)  # recomputed
