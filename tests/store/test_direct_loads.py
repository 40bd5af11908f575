"""Loads decoded straight into the caller's CPU blocks: withdrawals, failures and torch's
per-thread modes hold as they do for loads staged through host slots."""

import contextlib
import threading

import pytest
import torch

from tests.store.helpers import keys_for, make_store, payloads
from tiered_kv.errors import StoreClosed
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


@pytest.mark.parametrize("shared", [False, True], ids=["on_the_callers_thread", "in_pool_jobs"])
def test_load_into_never_returns_while_a_read_may_still_write_into_the_callers_blocks(tmp_path, monkeypatch,
                                                                                      shared):
    if shared:  # two pieces, read by the pool's jobs (the workers are free: they start in time)
        monkeypatch.setattr(direct_loads, "LEAST_PIECE_BYTES", 1)
        monkeypatch.setattr(direct_loads, "STAND_IN_AFTER", 60.0)  # (a hang guard only)
    with make_store(tmp_path) as store:
        keys = keys_for(3)
        store.save(keys, payloads(store, 3))
        store.flush()
        store.host.delete_many(keys[1:])  # key 0 is a host hit, keys 1 and 2 come from the disk tier
        real_read, real_release, caller = store.loader.reader.read, store.loader.release, threading.current_thread()
        order: list[str] = []  # what happened, in order (no clock)
        releasing = threading.Event()  # the caller failed and is releasing its plan

        def late_read(*args, **kwargs):
            if threading.current_thread() is not caller:  # a pool job: read only once the caller
                assert releasing.wait(60), "the caller never released its plan"  # is on its way out
            out = real_read(*args, **kwargs)
            order.append("read")
            return out

        def release(plan):
            releasing.set()
            real_release(plan)

        store.loader.reader.read = late_read
        store.loader.release = release
        wrong_shape = torch.zeros(3, dtype=store.dtype)  # the caller's bug, for the host hit
        try:
            store.load_into(keys, [wrong_shape] + [torch.zeros(store.shape, dtype=store.dtype) for _ in keys[1:]])
        except ValueError:
            order.append("raised")
        else:
            raise AssertionError("a destination of the wrong shape was accepted")
        assert order[-1] == "raised" and "read" in order, order
        assert store.pool.drain(10) and store.pool.queued_bytes() == {"save": 0, "load": 0}


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
        with workers_held(store):
            outs = [torch.zeros(store.shape, dtype=store.dtype) for _ in keys]
            done = []
            loader = threading.Thread(target=lambda: done.append(store.load_into(keys, outs)), daemon=True)
            loader.start()
            loader.join(10)
            assert done == [[True] * 6], "load_into waited for the pool's saves"
            assert all(torch.equal(o, d) for o, d in zip(outs, data))
        assert store.pool.drain(10)  # the cancelled jobs left no count behind
        assert store.pool.queued_bytes() == {"save": 0, "load": 0}


def test_a_load_shared_by_the_caller_and_a_pool_job_reads_every_block_once_and_says_which_were_there(
        tmp_path, monkeypatch):
    """The caller standing in at once (no wait for the jobs) while a job takes pieces too: the
    first read holds until another thread read, so both take part."""
    monkeypatch.setattr(direct_loads, "LEAST_PIECE_BYTES", 1)
    monkeypatch.setattr(direct_loads, "STAND_IN_AFTER", 0.0)
    with make_store(tmp_path, host="16MiB") as store:
        keys, data = keys_for(10), payloads(store, 10)
        absent = {3, 7}
        store.save([k for i, k in enumerate(keys) if i not in absent], [d for i, d in enumerate(data) if i not in absent])
        store.flush()
        store.host.delete_many(keys)  # every block present comes from the disk tier
        real, calls, second = store.loader.reader.read, [], threading.Event()
        lock = threading.Lock()

        def shared_read(read_keys, *args, **kwargs):
            with lock:
                calls.append((threading.get_ident(), list(read_keys)))
                first = len(calls) == 1
            if first:
                assert second.wait(10), "no other thread read a piece"
            else:
                second.set()
            return real(read_keys, *args, **kwargs)

        store.loader.reader.read = shared_read
        outs = [torch.zeros(store.shape, dtype=store.dtype) for _ in keys]
        ok = store.load_into(keys, outs)
        assert ok == [i not in absent for i in range(10)]
        assert all(torch.equal(outs[i], data[i]) for i in range(10) if i not in absent)
        assert sorted(k for _, ks in calls for k in ks) == sorted(keys), "a block read twice or not at all"
        assert len({thread for thread, _ in calls}) >= 2
        assert store.pool.drain(10) and store.pool.queued_bytes() == {"save": 0, "load": 0}


@pytest.mark.parametrize("dtype", [None, torch.float32], ids=["direct", "staged_through_slots"])
def test_load_into_after_close_raises_a_typed_error(tmp_path, dtype):
    store = make_store(tmp_path)
    keys = keys_for(2)
    store.save(keys, payloads(store, 2))
    store.flush()
    store.host.delete_many(keys[1:])  # one host hit, one from the disk tier
    store.close()
    with pytest.raises(StoreClosed):  # (a RuntimeError as before, and one of ours)
        store.load_into(keys, [torch.zeros(store.shape, dtype=dtype or store.dtype) for _ in keys])


@pytest.mark.parametrize("hits", ["consecutive", "scattered"])
def test_regression_closing_the_store_during_a_load_into_raised_index_and_torch_errors_into_the_caller(
        tmp_path, hits):
    with make_store(tmp_path, workers=1) as store:
        keys = keys_for(6)
        data = payloads(store, 6)
        store.save(keys, data)
        store.flush(10)
        store.host.delete_many(keys[4:])  # four host hits, two from the disk tier
        if hits == "scattered":  # host slots that are not one run
            keys, data = [keys[0], keys[2], keys[4], keys[5]], [data[0], data[2], data[4], data[5]]
        read = store.loader.reader.read

        def read_then_close(*args, **kwargs):  # another thread closes the store meanwhile
            out = read(*args, **kwargs)
            closing = threading.Thread(target=store.close)
            closing.start()
            closing.join(20)
            assert not closing.is_alive(), "close() hung behind a load_into"
            return out

        store.loader.reader.read = read_then_close
        outs = [torch.zeros(store.shape, dtype=store.dtype) for _ in keys]
        with pytest.raises(StoreClosed):
            store.load_into(keys, outs)


def test_a_failed_load_into_is_not_held_up_by_a_busy_pool_either(tmp_path, monkeypatch):
    """A destination of the wrong shape for a host hit fails the load after the caller read the
    rest: the pool jobs that never started are cancelled on the way out, not waited for."""
    monkeypatch.setattr(direct_loads, "LEAST_PIECE_BYTES", 1)
    with make_store(tmp_path) as store:
        keys = keys_for(4)
        store.save(keys, payloads(store, 4))
        store.flush()
        store.host.delete_many(keys[1:])  # key 0 is a host hit
        with workers_held(store):
            outs = [torch.zeros(3, dtype=store.dtype)] + [torch.zeros(store.shape, dtype=store.dtype) for _ in keys[1:]]
            raised = []

            def load():
                try:
                    store.load_into(keys, outs)
                except ValueError as exc:
                    raised.append(exc)

            loader = threading.Thread(target=load, daemon=True)
            loader.start()
            loader.join(10)
            assert raised, "load_into waited for the pool's saves before failing"
        assert store.pool.drain(10) and store.pool.queued_bytes() == {"save": 0, "load": 0}


@contextlib.contextmanager
def workers_held(store):
    """Every worker of ``store``'s pool busy with a save (a slow disk, a Redis put waiting out its
    timeout) until the block ends."""
    started, release = threading.Semaphore(0), threading.Event()

    def busy_save():
        started.release()
        release.wait(30)

    try:
        for _ in range(store.config.workers):
            store.pool.submit_save(1, busy_save)
        for _ in range(store.config.workers):
            assert started.acquire(timeout=10), "a worker did not take its save"
        yield
    finally:
        release.set()


@pytest.mark.parametrize("outs_short_by", [1, 2])
def test_regression_load_into_with_fewer_destinations_than_keys_said_true_for_keys_it_wrote_nowhere(tmp_path, outs_short_by):
    with make_store(tmp_path) as store:
        keys = keys_for(3)
        store.save(keys, payloads(store, 3))
        store.flush(10)
        outs = [torch.zeros(store.shape, dtype=store.dtype) for _ in range(3 - outs_short_by)]
        with pytest.raises(ValueError, match="3 keys into"):
            store.load_into(keys, outs)
