"""A save's device->host copy still running when the next step loads the same blocks (CUDA: the
copy is queued on a side stream and committed when its event completes). The save holds the
blocks' host slots until it is committed, and only the worker's thread commits: a load waiting
for that commit would hold the forward pass. Before a step's loads start, the worker waits for
the copies that hold a block a load reads and commits them; the load is then served from the
host tier. The CUDA branch of the copy is stood in for on a CPU pool: an event that is not done
until synchronized."""

from __future__ import annotations

import time

import pytest
import torch

from tests.connector.test_failed_load_sharing import BS, SHARED, _connector, _fill, _pool, _step
from tests.store.helpers import make_store, payloads
from tiered_kv.integrations.common import RequestStep, RequestView


class _CopyInFlight:
    """A CUDA event of a device->host copy the GPU has not finished until someone waits for it."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def _copies_on_a_side_stream(worker) -> None:
    """The worker's save copy as its CUDA branch leaves it: bytes in the slots, commit deferred."""
    def gather(block_ids, slots, batch, owners, state=False):
        rows = worker.layout.gather(torch.tensor(block_ids)).view(len(block_ids), -1).view(torch.uint8)
        worker.store.slots.fill(slots, rows)
        worker._saves.add(batch, owners, _CopyInFlight())
    worker._gather = gather


class _LoaderClock:
    """The loader's clock (``loading.time``): a sleep advances it at once instead of waiting, and
    every sleep is recorded. How long a load waited is then a count of what it did, not a
    measurement: the same on a loaded machine as on an idle one."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        time.sleep(0)  # (still a yield to the other threads)


@pytest.fixture
def loader_clock(monkeypatch) -> _LoaderClock:
    clock = _LoaderClock()
    monkeypatch.setattr("tiered_kv.store.loading.time", clock)
    return clock


def _compute_shared(conn, pool, request_id: str, last: int) -> None:
    """A step in which ``request_id`` computes SHARED's four blocks (no external tokens) and
    saves them."""
    view = RequestView(request_id, SHARED + [last], len(SHARED) + 1, None)
    conn.scheduler.get_num_new_matched_tokens(view, 0)
    conn.scheduler.update_state_after_alloc(view, [0, 1, 2, 3, 4], 0)
    _fill(pool, [0, 1, 2, 3], 1.0)
    _step(conn, new=[RequestStep(request_id, view.prompt_token_ids, [0, 1, 2, 3, 4], 0, len(view.prompt_token_ids))])
    conn.worker.wait_for_save()


def _seed(tmp_path) -> None:
    """A first engine saved SHARED's four blocks to disk and exited."""
    conn = _connector(tmp_path)
    pool = _pool()
    conn.register_kv_caches(pool)
    _compute_shared(conn, pool, "seed", 7)
    conn.store.flush()
    conn.close()


def test_regression_a_load_of_blocks_whose_save_was_still_copying_stalled_the_forward_and_failed(
        tmp_path, loader_clock):
    _seed(tmp_path)
    conn = _connector(tmp_path)  # a restart: the blocks are on disk, the host tier is empty
    pool = _pool()
    conn.register_kv_caches(pool)
    _copies_on_a_side_stream(conn.worker)
    _compute_shared(conn, pool, "A", 5)  # step 1: A computes the four blocks again; the copy runs on
    conn.worker.get_finished([], [])
    # step 2: B shares the four blocks, found on disk (a reserved slot is not a host hit): a sync load
    b = RequestView("B", SHARED + [9] * BS + [3], len(SHARED) + BS + 1, None)
    matched, is_async = conn.scheduler.get_num_new_matched_tokens(b, 0)
    assert (matched, is_async) == (4 * BS, False)
    conn.scheduler.update_state_after_alloc(b, [10, 11, 12, 13, 14, 15], matched)
    _step(conn, new=[RequestStep("B", b.prompt_token_ids, [10, 11, 12, 13, 14, 15], 0, BS + 1)])
    waited = sum(loader_clock.sleeps)  # (the loader's clock: waiting on a commit is sleeping on it)
    errors = conn.worker.get_block_ids_with_load_errors()
    try:
        assert not errors, f"the load failed after holding the forward {waited:.1f}s"
        assert loader_clock.sleeps == [], f"the forward waited {waited:.1f}s for the copy's commit"
        for block in (10, 11, 12, 13):  # A's bytes, served from the host tier
            assert torch.equal(pool[:, :, block], pool[:, :, block - 10])
        assert conn.store.metrics.misses("promotion_timeout") == 0
    finally:
        conn.close()


def test_a_load_waits_for_blocks_another_holds_reserved_once_per_job_not_once_per_block(monkeypatch, loader_clock):
    monkeypatch.setattr("tiered_kv.store.loading.PROMOTION_WAIT_S", 0.3)
    with make_store(None, workers=1) as store:
        keys = [bytes([i]) * 16 for i in range(6)]
        store.save(keys, payloads(store, 6))
        held = store.prepare_save([bytes([0x70 + i]) * 16 for i in range(6)])  # reserved, never committed
        plan = store.prepare_load(held.keys)
        store.load(plan).wait()
        waited = sum(loader_clock.sleeps)  # on the loader's clock: what it slept, not how long it took
        assert 0.3 <= waited < 2 * 0.3, f"{waited:.2f}s: each of the 6 blocks waited its own deadline"
        assert plan.reasons == ["promotion_timeout"] * 6
        store.release(plan)
        store.commit_save(held, ok=False)
