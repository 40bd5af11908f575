"""A block that fails to load poisons every request that shares it in that step (vLLM shares a
block loaded for request A with request B through its prefix cache): nothing computed over it is
saved, and once the engine recomputes, the recomputed KV replaces any stored copy.

Both connector halves are driven the way vLLM drives them (scheduler outputs with new and
cached requests, the worker's per-step calls) over a real LMDB store and a real KV pool."""

from __future__ import annotations

import pytest
import torch

from tests.store.helpers import NS, rewrite_stored_blocks
from tiered_kv.config import TieredKVConfig
from tiered_kv.connector import build_connector
from tiered_kv.integrations.common import RequestStep, RequestView, StepOutput

BS = NS.block_size
NUM_BLOCKS = 32
SHARED = list(range(1000, 1000 + 4 * BS))  # four full blocks both requests start with


def _pool() -> torch.Tensor:
    """The engine's KV pool, reference-engine layout [2, L, blocks, bs, H, D]."""
    return torch.zeros(2, NS.num_layers, NUM_BLOCKS, BS, NS.num_kv_heads, NS.head_dim, dtype=torch.bfloat16)


def _fill(pool: torch.Tensor, block_ids: list[int], value: float) -> None:
    for b in block_ids:
        pool[:, :, b] = value + b


def _connector(tmp_path):
    config = TieredKVConfig.from_dict({"host": {"capacity": "4MiB"}, "workers": 2,
                                       "disk": {"url": f"lmdb://{tmp_path}/db", "capacity": "64MiB"}})
    return build_connector(config, NS)


def _corrupt_on_disk(path, key: bytes) -> None:
    def flip(storage_key: bytes, value: bytes) -> bytes | None:
        if storage_key != NS.digest() + key:
            return None
        return value[:-7] + bytes([value[-7] ^ 0x5A]) + value[-6:]

    assert rewrite_stored_blocks(path, flip) == 1


def _step(conn, new=(), cached=()):
    meta = conn.scheduler.build_connector_meta(StepOutput(list(new), list(cached)))
    conn.worker.bind_connector_meta(meta)
    conn.worker.start_load_kv()
    for layer in range(conn.store.namespace.num_layers):  # the forward asks for each layer's KV
        conn.worker.wait_for_layer_load(layer)
    return meta


def _stored_copy(conn, key: bytes) -> torch.Tensor | None:
    out = torch.zeros(conn.store.shape, dtype=conn.store.dtype)
    ok = conn.store.load_into([key], [out])
    return out if ok[0] else None


def _seed_store(tmp_path, shared: list[int] = SHARED) -> list[bytes]:
    """A first engine saved the prompt ``shared`` + one token (every full block computed); its keys."""
    conn = _connector(tmp_path)
    tokens = shared + [7]
    blocks = list(range(len(tokens) // BS + 1))
    view = RequestView("seed", tokens, len(tokens), None)
    conn.scheduler.get_num_new_matched_tokens(view, 0)
    conn.scheduler.update_state_after_alloc(view, blocks, 0)
    pool = _pool()
    conn.register_kv_caches(pool)
    _fill(pool, blocks[:-1], 1.0)
    _step(conn, new=[RequestStep("seed", tokens, blocks, 0, len(tokens))])
    conn.worker.wait_for_save()
    keys = list(conn.scheduler.keys_of("seed"))
    conn.store.flush()
    conn.close()
    return keys


def test_blocks_computed_over_a_block_that_failed_to_load_for_another_request_are_not_saved(tmp_path):
    shared_keys = _seed_store(tmp_path)
    _corrupt_on_disk(tmp_path / "db", shared_keys[1])  # A's load of block 1 will fail
    conn = _connector(tmp_path)
    pool = _pool()
    conn.register_kv_caches(pool)
    a_tokens = SHARED + list(range(1, 2 * BS + 2))
    b_tokens = SHARED + list(range(5000, 5000 + 2 * BS + 1))
    a = RequestView("A", a_tokens, len(a_tokens), None)
    b = RequestView("B", b_tokens, len(b_tokens), None)
    # A matches the four stored blocks and loads them (sync) into device blocks 0..3
    assert conn.scheduler.get_num_new_matched_tokens(a, 0) == (4 * BS, False)
    a_blocks = [0, 1, 2, 3, 4, 5, 6]
    conn.scheduler.update_state_after_alloc(a, a_blocks, 4 * BS)
    # B, in the same step, shares A's blocks 0..3 through the engine's prefix cache
    assert conn.scheduler.get_num_new_matched_tokens(b, 4 * BS) == (0, False)
    b_blocks = [0, 1, 2, 3, 10, 11, 12]
    conn.scheduler.update_state_after_alloc(b, b_blocks, 0)
    meta = _step(conn, new=[RequestStep("A", a_tokens, a_blocks, 0, len(a_tokens) - 4 * BS),
                            RequestStep("B", b_tokens, b_blocks, 4 * BS, len(b_tokens) - 4 * BS)])
    assert [s.request_id for s in meta.saves] == ["A", "B"]
    assert conn.worker.get_block_ids_with_load_errors() == {1}
    _fill(pool, [4, 5, 10, 11], -3.0)  # the forward wrote KV computed over the garbage block 1
    conn.worker.wait_for_save()
    conn.worker.flush_copies()
    b_keys = conn.scheduler.keys_of("B")
    a_keys = conn.scheduler.keys_of("A")
    assert conn.store.locate(b_keys[4:6]) == [None, None], "B's KV over a failed block was saved"
    assert conn.store.locate(a_keys[4:6]) == [None, None]
    assert conn.store.metrics.snapshot()["events"]["saves_dropped_failed_load"] == 4
    conn.close()


def _saved_over_a_failed_block(tmp_path):
    """Request B shares the stored prefix (blocks 0-3, from vLLM's prefix cache) and saved its
    blocks 4 and 5, computed over block 1, which failed to load on another rank: (connector, KV
    pool, B's tokens, its block table)."""
    _seed_store(tmp_path)
    conn = _connector(tmp_path)
    pool = _pool()
    conn.register_kv_caches(pool)
    b_tokens = SHARED + list(range(5000, 5000 + 2 * BS + 1))
    b = RequestView("B", b_tokens, len(b_tokens), None)
    b_blocks = [0, 1, 2, 3, 10, 11, 12]
    conn.scheduler.get_num_new_matched_tokens(b, 4 * BS)
    conn.scheduler.update_state_after_alloc(b, b_blocks, 0)
    _fill(pool, [10, 11], -3.0)  # computed over a block that failed on the other rank
    _step(conn, new=[RequestStep("B", b_tokens, b_blocks, 4 * BS, len(b_tokens) - 4 * BS)])
    conn.worker.wait_for_save()
    conn.worker.flush_copies()
    return conn, pool, b_tokens, b_blocks


def test_kv_saved_over_a_block_that_failed_on_another_rank_is_withdrawn_and_recomputed_kv_stored(tmp_path):
    """This rank saved B's blocks 4 and 5 (its own loads succeeded); another rank's load of block 1
    failed, so B's KV after block 1 is wrong everywhere (it went through the all-reduce). The
    engine reports the failed block; every rank withdraws the keys computed over it, and the
    recomputed KV is what ends up stored."""
    conn, pool, b_tokens, b_blocks = _saved_over_a_failed_block(tmp_path)
    conn.store.flush()
    b_keys = conn.scheduler.keys_of("B")
    wrong = _stored_copy(conn, b_keys[4])
    assert wrong is not None and float(wrong.float().mean()) == -3.0 + 10
    conn.scheduler.blocks_failed({1})  # vLLM: update_connector_output(invalid_block_ids={1})
    other = RequestView("C", b_tokens, len(b_tokens), None)  # meanwhile nobody is promised them
    assert conn.scheduler.get_num_new_matched_tokens(other, 0) == (4 * BS, False)  # (blocks 0-3: stored)
    # the engine rolls B back to block 1 and recomputes blocks 1..5
    _fill(pool, [1, 2, 3, 10, 11], 2.0)
    meta = _step(conn, cached=[RequestStep("B", [], [], 1 * BS, len(b_tokens) - 1 * BS)])
    assert set(meta.invalidate) == set(b_keys[4:6])  # B computed those; blocks 2, 3 were loaded
    conn.worker.wait_for_save()
    conn.worker.flush_copies()
    conn.store.flush()
    assert float(_stored_copy(conn, b_keys[4]).float().mean()) == 2.0 + 10, "the wrong copy stayed"
    assert conn.store.metrics.snapshot()["events"]["blocks_invalidated"] == 2
    conn.close()
    reopened = _connector(tmp_path)  # and on disk, where the next process reads it
    assert float(_stored_copy(reopened, b_keys[4]).float().mean()) == 2.0 + 10
    assert float(_stored_copy(reopened, b_keys[2]).float().mean()) == 1.0 + 2  # the stored copy stays
    reopened.close()


def test_regression_under_vllms_fail_policy_kv_over_a_failed_block_stayed_stored(tmp_path):
    """vLLM's default ``kv_load_failure_policy = "fail"`` finishes the requests a failed load hit
    (``request_finished``) before it reports the failed blocks; the finished request was
    forgotten by then, so nothing this rank saved over the other rank's failed block was
    withdrawn, and a later request was served it."""
    conn, _, b_tokens, b_blocks = _saved_over_a_failed_block(tmp_path)
    b_keys = conn.scheduler.keys_of("B")
    conn.scheduler.request_finished(RequestView("B", b_tokens, len(b_tokens), None), b_blocks)  # FINISHED_ERROR
    conn.scheduler.blocks_failed({1})  # then update_connector_output(invalid_block_ids={1})
    meta = _step(conn)
    assert set(meta.invalidate) == set(b_keys[4:6])
    other = RequestView("C", b_tokens, len(b_tokens), None)
    assert conn.scheduler.get_num_new_matched_tokens(other, 0) == (4 * BS, False)  # the stored blocks only
    conn.worker.wait_for_save()
    assert _stored_copy(conn, b_keys[4]) is None
    conn.close()


def test_regression_a_failed_load_withdrew_the_blocks_the_request_had_loaded_fine(tmp_path):
    """A request whose load of block 1 failed withdrew every key after it in its table, its
    blocks 2 and 3 among them: loaded fine, their stored copies (shared by every replica) were
    deleted from every tier. Only the blocks it computed over the failed one are withdrawn now."""
    keys = _seed_store(tmp_path)
    _corrupt_on_disk(tmp_path / "db", keys[1])
    conn = _connector(tmp_path)
    conn.register_kv_caches(_pool())
    tokens = SHARED + list(range(1, 2 * BS + 2))
    a = RequestView("A", tokens, len(tokens), None)
    assert conn.scheduler.get_num_new_matched_tokens(a, 0) == (4 * BS, False)
    blocks = [0, 1, 2, 3, 4, 5, 6]
    conn.scheduler.update_state_after_alloc(a, blocks, 4 * BS)
    _step(conn, new=[RequestStep("A", tokens, blocks, 0, len(tokens) - 4 * BS)])
    assert conn.worker.get_block_ids_with_load_errors() == {1}
    conn.worker.wait_for_save()
    conn.worker.flush_copies()
    a_keys = conn.scheduler.keys_of("A")
    conn.scheduler.blocks_failed({1})  # vLLM: update_connector_output(invalid_block_ids={1})
    meta = _step(conn)
    assert set(meta.invalidate) == set(a_keys[4:6])
    conn.worker.wait_for_save()
    assert _stored_copy(conn, keys[2]) is not None and _stored_copy(conn, keys[3]) is not None
    conn.close()


def test_regression_a_request_preempted_before_the_failure_report_kept_its_kv_over_the_failed_block(tmp_path):
    """vLLM's async scheduling runs the next ``schedule()`` before the update that reports the
    step's failed blocks; a preemption there cleared the request's block table, so its saves
    computed over another rank's failed block were never withdrawn."""
    _seed_store(tmp_path)
    conn = _connector(tmp_path)
    conn.register_kv_caches(_pool())
    tokens = SHARED + list(range(7000, 7000 + 2 * BS + 1))
    a = RequestView("A", tokens, len(tokens), None)
    assert conn.scheduler.get_num_new_matched_tokens(a, 0) == (4 * BS, False)
    blocks = [0, 1, 2, 3, 4, 5, 6]
    conn.scheduler.update_state_after_alloc(a, blocks, 4 * BS)
    _step(conn, new=[RequestStep("A", tokens, blocks, 0, len(tokens) - 4 * BS)])  # step N: saves 4, 5
    conn.worker.wait_for_save()
    conn.worker.flush_copies()
    keys = conn.scheduler.keys_of("A")
    conn.scheduler.request_preempted("A")  # schedule(N+1)
    _step(conn)
    conn.scheduler.blocks_failed({1})  # update_from_output(N): block 1 failed on another rank
    assert set(_step(conn).invalidate) == set(keys[4:6])
    conn.close()


@pytest.mark.parametrize("preemption_seen", [True, False])  # False: vLLM's reset_prefix_cache resumes it at once
def test_regression_a_resumed_request_withdrew_its_own_saves_it_had_loaded_fine(tmp_path, preemption_seen):
    """A request that saved its blocks, was preempted and resumed loads them back; one of those
    loads failed, and the withdrawal still started where its first life's saves did, deleting
    the good stored copies of the blocks loaded after the failed one."""
    conn = _connector(tmp_path)
    conn.register_kv_caches(_pool())
    tokens = list(range(3000, 3000 + 6 * BS + 1))
    r = RequestView("R", tokens, len(tokens), None)
    assert conn.scheduler.get_num_new_matched_tokens(r, 0) == (0, False)
    conn.scheduler.update_state_after_alloc(r, list(range(7)), 0)
    _step(conn, new=[RequestStep("R", tokens, list(range(7)), 0, len(tokens))])  # saves blocks 0-5
    conn.worker.wait_for_save()
    conn.worker.flush_copies()
    keys = conn.scheduler.keys_of("R")
    if preemption_seen:
        conn.scheduler.request_preempted("R")
        _step(conn)
    assert conn.scheduler.get_num_new_matched_tokens(r, 0) == (6 * BS, False)
    again = list(range(20, 27))
    conn.scheduler.update_state_after_alloc(r, again, 6 * BS)
    _step(conn, new=[RequestStep("R", tokens, again, 0, 1)])
    conn.scheduler.blocks_failed({21})  # its load of block 1 failed (on some rank)
    meta = _step(conn)
    assert not set(meta.invalidate) & set(keys)
    conn.close()


def test_vllm_reports_of_failed_blocks_reach_the_next_plan(tmp_path):
    from types import SimpleNamespace

    from tests.integrations.vllm_engine import kv_cache_config, vllm_config
    from tiered_kv.integrations.vllm import KVConnectorRole, TieredKVConnector

    cfg = vllm_config({"disk": {"url": f"lmdb://{tmp_path}/db"}})
    sched = TieredKVConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())
    try:
        core = sched._sched._core()
        view = RequestView("r", SHARED + [1], len(SHARED) + 1, None)
        core.get_num_new_matched_tokens(view, 0)
        core.update_state_after_alloc(view, [7, 8, 9, 10, 11], 0)
        core.build_connector_meta(StepOutput([RequestStep("r", view.prompt_token_ids, [7, 8, 9, 10, 11], 0,
                                                          len(view.prompt_token_ids))], []))
        sched.update_connector_output(SimpleNamespace(invalid_block_ids={8}, finished_sending=None))
        meta = core.build_connector_meta(StepOutput([], []))
        assert meta.invalidate == tuple(core.keys_of("r")[2:5])  # blocks after 8 in the table
    finally:
        sched.shutdown()


def test_a_retired_host_copy_stays_readable_to_its_lease_and_invisible_to_everyone_else():
    from storage_backends.host import HostBackend

    host = HostBackend(capacity=4 << 10, slot_bytes=1 << 10, pinned="no")
    assert host.put_many([(b"k", b"old")]) == [True]
    (slot,) = host.pin_many([b"k"])  # a load in flight reads the old copy
    assert host.retire_many([b"k"]) == 1
    assert host.contains_many([b"k"]) == [False] and host.pin_many([b"k"]) == [None]
    assert bytes(host.slot_view(slot, 3).numpy()) == b"old"  # the lease still reads its bytes
    host.unpin_many([b"k"])
    assert host.stats().used_bytes == 0 and host.reserve_many([b"k"]) != [None]


def test_a_host_copy_retired_while_being_filled_is_never_published():
    from storage_backends.host import HostBackend

    host = HostBackend(capacity=4 << 10, slot_bytes=1 << 10, pinned="no")
    (slot,) = host.reserve_many([b"k"])  # a load is promoting the old copy right now
    host.retire_many([b"k"])
    host.commit_many([b"k"])
    assert host.contains_many([b"k"]) == [False] and host.stats().used_bytes == 0
    (slot,) = host.reserve_many([b"k"])  # the same, committed with a lease for its load
    host.retire_many([b"k"])
    host.commit_many([b"k"], pin=True)
    assert host.contains_many([b"k"]) == [False] and host.pin_many([b"k"]) == [None]
    host.unpin_many([b"k"])
    assert host.stats().used_bytes == 0


def test_regression_failed_async_loads_were_kept_for_good_by_engines_that_never_take_them(tmp_path):
    # our engine and TensorRT-LLM get failed blocks as load errors; the request ids kept for
    # vLLM's transfer results grew by one per failed async load for the life of the process
    from tests.connector.engine_helpers import GREEDY, connector, engine, prompt, reference

    shared = prompt(160, seed=5)
    prompts = [shared + prompt(40, seed=6), shared + prompt(70, seed=7)]
    first = connector(tmp_path / "db")
    engine(first).generate([shared + prompt(3, seed=8)], GREEDY)
    first.close()
    seen = []

    def flip(key: bytes, value: bytes) -> bytes | None:
        seen.append(key)
        return value[:200] + bytes([value[200] ^ 0xFF]) + value[201:] if len(seen) == 5 else None

    assert rewrite_stored_blocks(tmp_path / "db", flip) == 1
    conn = connector(tmp_path / "db", load_async=True)
    try:
        outs = engine(conn).generate(prompts, GREEDY)
        assert [o.output_token_ids for o in outs] == reference(prompts)
        assert conn.store.metrics.misses() > 0  # the corrupt block was met and recomputed
        assert conn.worker.take_failed_requests() == set()
    finally:
        conn.close()
