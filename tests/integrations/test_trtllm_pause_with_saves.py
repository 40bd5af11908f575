"""A request paused by TensorRT-LLM's MAX_UTILIZATION capacity scheduler after its blocks were
saved (``_pause_requests``: ``LlmRequest.pause``, then ``_terminate_request`` ->
``KvCacheConnectorManager.request_finished``). A True there sets the request to
``DISAGG_CONTEXT_TRANS_IN_PROGRESS``, which ``get_finished`` never moves it out of: the adapter
answers False for a request that is not finished, and has its worker finish its copies of the
blocks (freed at once) before the next forward."""

from __future__ import annotations

from tests.integrations.test_trtllm import _NoConnector, matched, prompt, run
from tests.integrations.trtllm_executor import Executor, store_llm_args
from tiered_kv.integrations.trtllm import TieredKVScheduler, TieredKVWorker


def _paused_run(sched, worker, p):
    """``p`` prefilled, one token generated, paused, then run to the end: its output."""
    ex = Executor(sched, worker)
    ex.add(1, p, max_new_tokens=6)
    ex.step()  # prefill (its 4 full blocks saved) and a first token
    ex.step()  # a second token
    ex.pause(1)
    return ex.run(max_steps=50)[1], ex


def test_regression_a_request_paused_with_saves_in_flight_was_held_in_a_transfer_state_for_good(
        tmp_path, monkeypatch):
    # The old adapter answered True (saves were planned for it): TensorRT-LLM parked the paused
    # request in DISAGG_CONTEXT_TRANS_IN_PROGRESS and never scheduled it again.
    llm_args = store_llm_args(tmp_path, monkeypatch)
    p = prompt(17, 31)
    reference, _ = _paused_run(_NoConnector(), _NoConnector(), p)
    sched, worker = TieredKVScheduler(llm_args), TieredKVWorker(llm_args)
    try:
        out, ex = _paused_run(sched, worker, p)
        assert [d for _, e, r, d in ex.log if e == "paused"] == [False]  # its blocks went back at once
        assert out == reference and ex.requests[1].state == "done"
        assert not ex.held and not worker._saving
    finally:
        sched.close()
        worker.close()
    # what it computed before and after the pause is stored under its own keys
    tokens = ex.requests[1].tokens
    assert matched(run(llm_args, {2: tokens + [7]})[1])[2] == (len(tokens) // 4 * 4, False)


def test_a_request_that_finishes_after_a_pause_is_still_held_until_its_saves_are_reported(
        tmp_path, monkeypatch):
    # a pause is not a finish: the request's later finish holds its blocks as any finish does
    llm_args = store_llm_args(tmp_path, monkeypatch)
    sched, worker = TieredKVScheduler(llm_args), TieredKVWorker(llm_args)
    try:
        _, ex = _paused_run(sched, worker, prompt(17, 32))
        assert [d for _, e, r, d in ex.log if e == "finished"] == [True]
        assert [r for _, e, r, _ in ex.log if e == "saved"] == [1]
    finally:
        sched.close()
        worker.close()


def test_regression_a_request_cancelled_while_paused_left_its_state_in_the_connector_for_good(
        tmp_path, monkeypatch):
    # TensorRT-LLM calls no connector method for a request it does not hold blocks of
    # (_do_terminate_request: get_cache_indices raises): a request cancelled (or failed, or cut
    # off at shutdown) while paused is never passed to request_finished nor get_finished, so the
    # pause itself must leave nothing behind (its tokens and key chain, the workers' save ids)
    from tests.integrations.test_trtllm_bounded_state import _sizes

    llm_args = store_llm_args(tmp_path, monkeypatch)
    sched, worker = TieredKVScheduler(llm_args), TieredKVWorker(llm_args)
    try:
        ex = Executor(sched, worker)
        ex.add(1, prompt(17, 31), max_new_tokens=6)
        ex.step()  # prefill: its full blocks saved
        ex.step()
        ex.pause(1)
        ex.requests[1].state = "done"  # cancelled before the capacity scheduler took it again
        for _ in range(10):
            ex.step()
        assert {k: n for k, n in _sizes(sched, worker).items() if n} == {}
    finally:
        sched.close()
        worker.close()
