"""TensorRT-LLM's request lifecycle orders beyond a plain finish, through the adapter's two halves:
a cancel while the request's async load is in flight (``_handle_canceled_requests`` ->
``_terminate_request``: ``request_finished``, then its blocks freed, within the step) and a pause
(``_pause_requests``: ``request_finished``, blocks freed, the request scheduled again later, listed
by ``KvCacheConnectorSchedulerOutputManager`` as *cached* with deltas against its old blocks)."""

from __future__ import annotations

from tests.integrations.test_trtllm import matched, prompt, run
from tests.integrations.trtllm_executor import BS, Executor, store_llm_args
from tiered_kv.integrations.trtllm import TieredKVScheduler, TieredKVWorker


def _engine(llm_args, **kw):
    sched, worker = TieredKVScheduler(llm_args), TieredKVWorker(llm_args)
    return sched, worker, Executor(sched, worker, **kw)


def test_a_request_cancelled_while_its_async_load_runs_never_writes_the_blocks_another_request_gets(
        tmp_path, monkeypatch):
    # TensorRT-LLM frees a cancelled loading request's blocks in the step (request_finished said
    # no hold), and hands them out at the next step's allocation. The load must have been copied
    # in before that: it is (its blocks are host slots the scheduler half read, so it ends in the
    # get_finished of the step that started it), and the next request's KV is its own.
    llm_args = store_llm_args(tmp_path, monkeypatch)
    a, b = prompt(24, 7), prompt(24, 8)
    run(llm_args, {1: a})  # stores a's blocks
    reference = run(llm_args, {2: b}, connector=False)[0][2]
    monkeypatch.setenv("TIERED_KV_LOAD_ASYNC", "1")
    sched, worker, ex = _engine(llm_args, num_blocks=8)  # a takes 6 of 8: b must reuse a's
    try:
        ex.add(1, a)
        ex.cancel(1)  # reaches the executor while a's load is in flight
        ex.step()
        assert matched(ex)[1] == (20, True)
        assert [(e, d) for _, e, r, d in ex.log if r == 1][1:] == [("finished", False), ("loaded", None)]
        assert not worker.core._async_loads  # nothing of a's load is left to write anywhere
        a_blocks = set(range(6))
        ex.add(2, b)
        ex.step()
        assert a_blocks & set(ex.requests[2].block_ids)
        assert ex.run()[2] == reference
    finally:
        sched.close()
        worker.close()


def test_regression_a_paused_request_scheduled_again_saved_its_blocks_under_keys_of_a_repeated_token(
        tmp_path, monkeypatch):
    # The old adapter appended the output manager's stale deltas to the new allocation: the token
    # sampled after the last listing (already in the new prompt) came twice, so every block from
    # there on was stored under the key of a sequence with that token repeated.
    llm_args = store_llm_args(tmp_path, monkeypatch)
    p = prompt(16, 11)
    run(llm_args, {9: p})  # its 4 blocks stored: the paused request saves nothing before it pauses
    sched, worker, ex = _engine(llm_args)
    try:
        ex.add(1, p + [5], max_new_tokens=8)
        ex.step()  # 16 tokens hit, position 16 prefilled
        ex.step()  # position 17
        ex.pause(1)
        assert [d for _, e, r, d in ex.log if e == "paused"] == [False]  # freed, scheduled again
        ex.run()
        tokens = ex.requests[1].tokens
    finally:
        sched.close()
        worker.close()
    assert len(tokens) == 25 and tokens[19] != tokens[18]
    # what the paused request really computed is stored under its own keys...
    real = {2: tokens[:24] + [3]}
    assert matched(run(llm_args, real)[1])[2] == (24, False)
    # ...and a prompt that repeats its token 18 is served no KV computed over token 19
    repeated = {3: tokens[:19] + [tokens[18]] + prompt(4, 12)}
    outs, ex = run(llm_args, repeated)
    assert outs == run(llm_args, repeated, connector=False)[0]
    assert matched(ex)[3] == (4 * BS, False)  # landed code: (20, False), block 4 over another token
