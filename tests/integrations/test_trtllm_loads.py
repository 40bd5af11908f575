"""The TensorRT-LLM worker's loads of promised blocks: TensorRT-LLM cannot be told that a load
failed (it computes over whatever the pool holds), so a promised block must reach the pool
whatever the forward does with the per-layer hooks."""

from __future__ import annotations

from tests.integrations.test_trtllm import PROMPTS, matched, run
from tests.integrations.trtllm_executor import Executor, store_llm_args
from tiered_kv.integrations.trtllm import TieredKVScheduler, TieredKVWorker


class _NoLayerHooks:
    """The worker as a forward that runs no per-layer hook sees it."""

    def wait_for_layer_load(self, layer_idx, stream=None) -> None:
        pass

    def save_kv_layer(self, layer_idx, stream=None) -> None:
        pass


class _ForwardWithoutLayerHooks(Executor):
    """A forward whose per-layer hooks do not run (TensorRT-LLM replaying a captured graph, or a
    compiled forward): ``wait_for_layer_load`` is never called; ``start_load_kv`` and
    ``wait_for_save`` are, around it."""

    def _forward(self, batch) -> None:
        worker, self.worker = self.worker, _NoLayerHooks()
        try:
            super()._forward(batch)
        finally:
            self.worker = worker


def test_regression_layerwise_loads_a_forward_did_not_wait_for_left_trtllm_computing_over_stale_blocks(
        tmp_path, monkeypatch):
    llm_args = store_llm_args(tmp_path, monkeypatch)
    monkeypatch.setenv("TIERED_KV_LAYERWISE_LOADS", "true")  # ("auto" is on for a CUDA pool)
    reference, _ = run(llm_args, PROMPTS, connector=False)
    run(llm_args, PROMPTS)  # stores every prompt
    sched, worker = TieredKVScheduler(llm_args), TieredKVWorker(llm_args)
    ex = _ForwardWithoutLayerHooks(sched, worker)
    for rid, tokens in PROMPTS.items():
        ex.add(rid, tokens)
    try:
        outputs = ex.run()
    finally:
        sched.close()
        worker.close()
    assert all(n > 0 for n, _ in matched(ex).values())  # every request was promised loaded blocks
    # landed code: the layer-wise loads failed every promised block (their layers were never
    # waited for), TensorRT-LLM computed over the pool's stale blocks and answered otherwise
    assert outputs == reference
