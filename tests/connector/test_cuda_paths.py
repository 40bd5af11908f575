"""Blocks between a GPU's KV pool and the pinned host tier: the Triton gather/scatter, the side
stream that saves, the copies straight from the pinned slab that load, and the store's own API
with device tensors. The CUDA scenarios run where a GPU is present (tools/bench_cuda.py measures
the same paths); the slot-run logic they rely on is checked everywhere."""

from __future__ import annotations

import pytest
import torch

from tests.store.helpers import NS, keys_for, make_store, payloads
from tiered_kv.connector.block_copy import (
    gather_torch,
    gather_triton,
    scatter_torch,
    scatter_triton,
    use_triton,
)
from tiered_kv.connector.meta import ConnectorMeta, LoadSpec, SaveSpec
from tiered_kv.connector.worker import ConnectorWorker

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BS = NS.block_size


def _pool(num_blocks: int, device: str) -> torch.Tensor:
    """The reference engine's KV pool ``[2, L, blocks, bs, H, D]``."""
    return torch.zeros(2, NS.num_layers, num_blocks, BS, NS.num_kv_heads, NS.head_dim,
                       dtype=torch.bfloat16, device=device)


def test_consecutive_slots_are_copied_as_one_run_only_when_a_slot_holds_exactly_one_block(tmp_path):
    with make_store(tmp_path, disk=None) as store:
        assert store.host.slot_bytes == store.block_nbytes
        assert store.slots.runs([3, 4, 5, 9, 2, 3]) == [(0, 3, 3), (3, 9, 1), (4, 2, 2)]
        assert store.slots.runs([]) == []
        store.host.slot_bytes += 1  # what a slab of larger slots would look like
        try:
            assert store.slots.runs([3, 4]) == [(0, 3, 1), (1, 4, 1)]
        finally:
            store.host.slot_bytes -= 1


def test_blocks_fill_and_leave_slots_run_by_run_with_the_same_bytes(tmp_path):
    with make_store(tmp_path, disk=None) as store:
        blocks = torch.stack(payloads(store, 5))
        slots = [7, 8, 9, 2, 4]
        store.slots.fill(slots, blocks.view(5, -1).view(torch.uint8), non_blocking=True)
        for slot, block in zip(slots, blocks):
            assert torch.equal(store.slot_tensor(slot), block)
        back = store.slots.to_device(slots[::-1], torch.device("cpu"))
        assert torch.equal(back, blocks.flip(0))


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_gather_and_scatter_on_the_gpu_move_the_same_bytes_as_torch(dtype):
    assert use_triton(torch.device("cuda"))
    kv = torch.randn(2, 3, 40, 16, 8, 128, device="cuda").to(dtype)  # chunk 16384: 16 tiles
    ids = torch.tensor([39, 0, 17, 5], device="cuda")
    assert torch.equal(gather_triton(kv, ids), gather_torch(kv, ids))
    src = torch.randn(4, 3, 2, 16, 8, 128, device="cuda").to(dtype)
    a, b = kv.clone(), kv.clone()
    scatter_triton(a, ids, src)
    scatter_torch(b, ids, src)
    assert torch.equal(a, b)


def _worker(store, pool: torch.Tensor) -> ConnectorWorker:
    worker = ConnectorWorker(store)
    worker.register_kv_caches(pool)
    return worker


def _step(worker: ConnectorWorker, *, loads=(), saves=()) -> None:
    worker.bind_connector_meta(ConnectorMeta(loads=list(loads), saves=list(saves)))
    worker.start_load_kv()
    for layer in range(worker.store.namespace.num_layers):  # the forward asks for each layer's KV
        worker.wait_for_layer_load(layer)
    worker.wait_for_save()
    worker.clear_connector_metadata()


@cuda
def test_blocks_saved_from_the_gpu_come_back_into_other_blocks_of_a_fresh_pool(tmp_path):
    keys = keys_for(12)
    pool = _pool(64, "cuda")
    with make_store(tmp_path, host="8MiB", disk="64MiB") as store:
        worker = _worker(store, pool)
        src_ids = list(range(40, 52))
        # written on the engine's stream just before the save: the side stream must wait for it
        values = torch.randn(pool[:, :, 40:52].shape, device="cuda").to(pool.dtype)
        torch.cuda._sleep(50_000_000)
        pool[:, :, 40:52] = values
        _step(worker, saves=[SaveSpec("r1", tuple(keys), tuple(src_ids), 0)])
        worker.flush_copies()
        assert store.flush(30)
        saved = {k: store.slot_tensor(s).clone() for k, s in zip(keys, store.host.pin_many(keys))}
        store.host.unpin_many(keys)
        expected = gather_torch(pool, torch.tensor(src_ids, device="cuda")).cpu()
        for i, k in enumerate(keys):
            assert torch.equal(saved[k], expected[i])
        worker.close()
    fresh = _pool(64, "cuda")
    dst_ids = [3, 9, 4, 5, 6, 60, 61, 62, 1, 2, 30, 31]
    with make_store(tmp_path, host="8MiB", disk="64MiB") as store:  # a restart: every block from disk
        worker = _worker(store, fresh)
        _step(worker, loads=[LoadSpec("r2", tuple(keys), tuple(dst_ids), is_async=False)])
        assert worker.get_block_ids_with_load_errors() == set()
        got = gather_torch(fresh, torch.tensor(dst_ids, device="cuda")).cpu()
        assert torch.equal(got, expected)
        worker.close()


@cuda
def test_host_slots_released_after_a_load_can_be_reused_at_once_without_touching_the_loaded_blocks(tmp_path):
    keys = keys_for(16)
    with make_store(tmp_path, host="8MiB", disk=None) as store:
        blocks = payloads(store, 16, seed=3)
        store.save(keys, blocks)
        pool = _pool(32, "cuda")
        worker = _worker(store, pool)
        torch.cuda._sleep(50_000_000)  # the engine's stream is busy when the load starts
        _step(worker, loads=[LoadSpec("r", tuple(keys), tuple(range(16)), is_async=False)])
        slots = store.host.pin_many(keys)
        for s in slots:  # the loaded copies must have been taken already
            store.slot_tensor(s).fill_(0)
        store.host.unpin_many(keys)
        got = gather_torch(pool, torch.arange(16, device="cuda")).cpu()
        assert torch.equal(got, torch.stack(blocks))
        worker.close()


@cuda
def test_the_store_saves_and_loads_gpu_tensors_through_every_tier(tmp_path):
    keys = keys_for(10)
    with make_store(tmp_path, host="1MiB", disk="64MiB") as store:
        blocks = [b.cuda() for b in payloads(store, 10, seed=5)]
        store.save(keys, blocks)
        assert store.flush(30)
    with make_store(tmp_path, host="1MiB", disk="64MiB") as store:  # a restart: all from disk
        outs = [torch.empty_like(b) for b in blocks]
        assert store.load_into(keys, outs) == [True] * 10
        for out, block in zip(outs, blocks):
            assert torch.equal(out, block)


@cuda
def test_a_save_returns_while_the_engines_stream_is_still_busy(tmp_path):
    """The side stream waits for the engine's queued work; the host must not (a host wait there
    would stall an engine that queues its next step while the GPU runs this one)."""
    keys = keys_for(4)
    pool = _pool(16, "cuda")
    with make_store(tmp_path, host="8MiB", disk=None) as store:
        worker = _worker(store, pool)
        pool[:, :, 4:8] = 1.5
        torch.cuda._sleep(2_000_000_000)  # about a second of queued engine work
        worker.bind_connector_meta(ConnectorMeta(saves=[SaveSpec("r", tuple(keys), (4, 5, 6, 7), 0)]))
        worker.wait_for_save()
        assert not torch.cuda.current_stream().query(), "wait_for_save waited for the engine's stream"
        worker.flush_copies()
        slots = store.host.pin_many(keys)
        assert all(s is not None and bool((store.slot_tensor(s) == 1.5).all()) for s in slots)
        store.host.unpin_many(keys)
        worker.close()


@cuda
def test_a_load_waits_for_its_own_copies_not_for_the_engines_queued_work(tmp_path):
    keys = keys_for(8)
    with make_store(tmp_path, host="8MiB", disk=None) as store:
        blocks = payloads(store, 8, seed=4)
        store.save(keys, blocks)
        pool = _pool(16, "cuda")
        worker = _worker(store, pool)
        torch.cuda._sleep(2_000_000_000)  # about a second of the engine's previous step
        _step(worker, loads=[LoadSpec("r", tuple(keys), tuple(range(8, 16)), is_async=False)])
        assert not torch.cuda.current_stream().query(), "the load waited for the engine's stream"
        got = gather_torch(pool, torch.arange(8, 16, device="cuda")).cpu()  # ordered after the scatter
        assert torch.equal(got, torch.stack(blocks))
        worker.close()


@cuda
def test_regression_blocks_freed_after_a_save_were_overwritten_by_the_next_step_before_the_gather_read_them(tmp_path):
    """A preempted (vLLM) or paused (TensorRT-LLM) request's blocks go back to the engine while its
    save's gather, queued on the side stream, may not have run: the engine's next step must wait
    for that gather (only it: the copy to the host is not waited for)."""
    keys = keys_for(4)
    pool = _pool(16, "cuda")
    with make_store(tmp_path, host="8MiB", disk=None) as store:
        worker = _worker(store, pool)
        pool[:, :, 4:8] = 1.5
        plain = worker.layout.gather

        def slow_gather(ids):  # the side stream busy when the gather is queued
            torch.cuda._sleep(500_000_000)
            return plain(ids)

        worker.layout.gather = slow_gather
        worker.bind_connector_meta(ConnectorMeta(saves=[SaveSpec("r", tuple(keys), (4, 5, 6, 7), 0)]))
        worker.wait_for_save()
        pool[:, :, 4:8] = -3.0  # the next step writes the freed blocks, on the engine's stream
        worker.flush_copies()
        slots = store.host.pin_many(keys)
        assert all(s is not None and bool((store.slot_tensor(s) == 1.5).all()) for s in slots)
        store.host.unpin_many(keys)
        worker.close()
