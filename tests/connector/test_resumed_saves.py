"""A request vLLM preempted and resumed starts a new life: its saves are planned from where that
life starts computing. Its device prefix hit and the blocks it loads are not its own saves: a
loaded block that failed to load must not be stored (it holds whatever the device block held),
nor the blocks computed over it in the same step.

Driven as vLLM drives the connector: the preemption reported (``preempted_req_ids``), then the
request matched again, allocated and scheduled as new with its local hit and external tokens."""

from __future__ import annotations

from tests.connector.test_failed_load_sharing import (
    BS,
    _connector,
    _corrupt_on_disk,
    _fill,
    _pool,
    _seed_store,
    _step,
)
from tiered_kv.integrations.common import RequestStep, RequestView

SHARED = list(range(1000, 1000 + 6 * BS))  # six full blocks another request stored


def test_a_resumed_request_does_not_store_a_block_that_failed_to_load_nor_kv_computed_over_it(tmp_path):
    shared_keys = _seed_store(tmp_path, SHARED)
    _corrupt_on_disk(tmp_path / "db", shared_keys[4])  # the resumed request's load of block 4 fails
    conn = _connector(tmp_path)
    pool = _pool()
    conn.register_kv_caches(pool)
    tokens = SHARED + list(range(1, 2 * BS + 2))
    view = RequestView("R", tokens, len(tokens), None)
    # first life: a chunk of three blocks computed and saved, then preempted
    conn.scheduler.update_state_after_alloc(view, [10, 11, 12], 0)
    meta = _step(conn, new=[RequestStep("R", tokens, [10, 11, 12], 0, 3 * BS)])
    _fill(pool, [10, 11, 12], 1.0)
    conn.worker.wait_for_save()
    assert [(s.first_block, len(s.keys)) for s in meta.saves] == [(0, 3)]
    conn.scheduler.request_preempted("R")
    conn.worker.flush_copies()
    # resumed: blocks 0-2 a device prefix hit, blocks 3-5 loaded (sync), the rest computed
    assert conn.scheduler.get_num_new_matched_tokens(view, 3 * BS) == (3 * BS, False)
    blocks = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    conn.scheduler.update_state_after_alloc(view, blocks, 3 * BS)
    meta = _step(conn, new=[RequestStep("R", tokens, blocks, 3 * BS, len(tokens) - 6 * BS)])
    assert conn.worker.get_block_ids_with_load_errors() == {14}
    assert [(s.first_block, s.block_ids) for s in meta.saves] == [(6, (16, 17))]
    _fill(pool, [16, 17], -3.0)  # the forward computed them over the garbage block 14
    conn.worker.wait_for_save()
    conn.worker.flush_copies()
    conn.store.flush()
    where = conn.store.locate(conn.scheduler.keys_of("R")[:8])
    assert where[4] is None, "the block that failed to load was stored with the device block's garbage"
    assert where[6:8] == [None, None], "KV computed over a block that failed to load was stored"
    assert conn.store.metrics.snapshot()["events"]["saves_dropped_failed_load"] == 2
    conn.close()
