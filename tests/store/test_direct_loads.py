"""Loads decoded straight into the caller's CPU blocks: withdrawals, failures and torch's
per-thread modes hold as they do for loads staged through host slots."""

import threading
import time

import pytest
import torch

from tests.store.helpers import keys_for, make_store, payloads
from tiered_kv.store import direct_loads


def test_a_block_withdrawn_while_it_is_loaded_directly_is_not_written_to_a_tier_it_just_earned(tmp_path):
    tiers = [{"name": "ssd2", "url": f"file://{tmp_path}/ssd2", "admit_after_hits": 2}]
    with make_store(tmp_path, tiers=tiers) as store:
        keys = keys_for(1)
        store.save(keys, payloads(store, 1))  # request 1: the disk tier admits at once
        store.flush()
        store.host.delete_many(keys)  # the next load comes from the disk tier
        real, withdrawn = store.loader.reader.read, []

        def read_then_withdraw(*args, **kwargs):
            out = real(*args, **kwargs)
            withdrawn.append(store.invalidate(keys))  # the scheduler learns the KV may be wrong
            return out

        store.loader.reader.read = read_then_withdraw
        store.load_into(keys, [torch.zeros(store.shape, dtype=store.dtype)])  # request 2 earns ssd2
        withdrawn[0].result(10)
        store.flush()
        assert store.tier("ssd2").contains(keys) == [False], "the withdrawn block came back after its delete"
        assert store.tier("disk").contains(keys) == [False]


def test_load_into_never_returns_while_a_read_may_still_write_into_the_callers_blocks(tmp_path):
    with make_store(tmp_path) as store:
        keys = keys_for(2)
        store.save(keys, payloads(store, 2))
        store.flush()
        store.host.delete_many(keys[1:])  # key 0 is a host hit, key 1 comes from the disk tier
        real, finished = store.loader.reader.read, []

        def slow_read(*args, **kwargs):
            time.sleep(0.3)
            out = real(*args, **kwargs)
            finished.append(time.monotonic())
            return out

        store.loader.reader.read = slow_read
        wrong_shape = torch.zeros(3, dtype=store.dtype)  # the caller's bug, for the host hit
        try:
            store.load_into(keys, [wrong_shape, torch.zeros(store.shape, dtype=store.dtype)])
        except ValueError:
            raised = time.monotonic()
        else:
            raise AssertionError("a destination of the wrong shape was accepted")
        assert finished and finished[0] <= raised


def test_small_blocks_copied_on_helper_threads_under_inference_mode(tmp_path):
    """torch's inference mode is per thread: the helpers copying shares of a batch must not
    refuse in-place copies the caller's own thread would make."""
    with torch.inference_mode():
        store = make_store(tmp_path, host="16MiB")  # its slab is an inference tensor
    try:
        store.copier.min_bytes = 0  # spread every batch over the helpers
        keys, data = keys_for(400), payloads(store, 400)
        with torch.inference_mode():
            store.save(keys, data)
            outs = [torch.zeros(store.shape, dtype=store.dtype) for _ in keys]
            assert store.load_into(keys, outs) == [True] * 400
        assert all(torch.equal(o, d) for o, d in zip(outs, data))
        plain = [torch.zeros(store.shape, dtype=store.dtype) for _ in keys]  # outside inference mode
        assert store.load_into(keys, plain) == [True] * 400
        assert all(torch.equal(o, d) for o, d in zip(plain, data))
    finally:
        store.close()


@pytest.mark.parametrize("piece_bytes", [direct_loads.LEAST_PIECE_BYTES, 1], ids=["one_piece", "pieces"])
def test_a_load_into_is_not_held_up_by_a_pool_busy_with_write_behind(tmp_path, monkeypatch, piece_bytes):
    """Both workers busy with saves (a slow disk, a Redis put waiting out its timeout): the
    caller reads the blocks itself (a load of one piece at once; one of several pieces once no
    pool job started), and the pool's jobs that never started are cancelled."""
    monkeypatch.setattr(direct_loads, "LEAST_PIECE_BYTES", piece_bytes)
    with make_store(tmp_path) as store:
        keys = keys_for(6)
        data = payloads(store, 6)
        store.save(keys, data)
        store.flush()
        store.host.delete_many(keys)  # every block comes from the disk tier
        started, release = threading.Semaphore(0), threading.Event()

        def busy_save():
            started.release()
            release.wait(30)

        try:
            for _ in range(store.config.workers):
                assert store.pool.submit_save(1, busy_save) is not None
            for _ in range(store.config.workers):
                assert started.acquire(timeout=10), "a worker did not take its save"
            outs = [torch.zeros(store.shape, dtype=store.dtype) for _ in keys]
            done = []
            loader = threading.Thread(target=lambda: done.append(store.load_into(keys, outs)), daemon=True)
            loader.start()
            loader.join(10)
            assert done == [[True] * 6], "load_into waited for the pool's saves"
            assert all(torch.equal(o, d) for o, d in zip(outs, data))
            release.set()
            assert store.pool.drain(10) and store.pool.jobs == 0  # the cancelled jobs left no count
        finally:
            release.set()
