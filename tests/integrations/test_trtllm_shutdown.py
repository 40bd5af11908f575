"""The TensorRT-LLM scheduler half while its store closes under it (the process's exit handler
closes every store; TensorRT-LLM's executor thread may still be admitting a request)."""

from __future__ import annotations

from tests.integrations.test_trtllm import prompt
from tests.integrations.trtllm_executor import Executor, LlmRequest, store_llm_args
from tiered_kv.integrations.trtllm import TieredKVScheduler, TieredKVWorker


def test_regression_a_store_closed_between_the_lookup_and_the_read_raised_into_the_engine(tmp_path, monkeypatch):
    llm_args = store_llm_args(tmp_path, monkeypatch)
    tokens = prompt(24, 3)
    sched, worker = TieredKVScheduler(llm_args), TieredKVWorker(llm_args)
    ex = Executor(sched, worker)
    ex.add(1, tokens)
    ex.run()
    sched.close()
    worker.close()

    sched = TieredKVScheduler(llm_args)  # a new engine: the blocks are on disk, not in its host tier
    looked_up = sched.core.index.lookup

    def lookup_then_exit(keys):
        found = looked_up(keys)
        sched.store.close()  # the exit handler, on the main thread, right after the lookup
        return found

    sched.core.index.lookup = lookup_then_exit
    try:
        request = LlmRequest(2, tokens, 24, 1)
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False)  # landed code: StoreClosed
        sched.update_state_after_alloc(request, list(range(6)))
        assert not sched.request_finished(request, list(range(6)))
    finally:
        sched.close()
