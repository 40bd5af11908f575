"""The TensorRT-LLM adapter where the engine's requests and steps are not the plain case: a
multimodal prompt (the same placeholder ids for every image) and a step whose forward raises
(TensorRT-LLM then skips ``wait_for_save`` and ends every active request)."""

from __future__ import annotations

from tests.integrations.test_trtllm import PROMPTS, matched, prompt
from tests.integrations.trtllm_executor import Executor, store_llm_args
from tiered_kv.integrations.trtllm import TieredKVScheduler, TieredKVWorker


def _engine(llm_args, executor=Executor):
    sched, worker = TieredKVScheduler(llm_args), TieredKVWorker(llm_args)
    return sched, worker, executor(sched, worker)


def _run_image(llm_args, rid: int, tokens: list[int], image: int) -> tuple[int, bool]:
    """One engine serving one request whose prompt holds an image named by hash ``image``."""
    sched, worker, ex = _engine(llm_args)
    try:
        req = ex.add(rid, tokens)
        req.multimodal_hashes = [[image] * 8]  # TensorRT-LLM: 8 int32 words per item
        req.multimodal_positions, req.multimodal_lengths = [4], [12]
        ex.run()
        return matched(ex)[rid]
    finally:
        sched.close()
        worker.close()


def test_a_prompt_with_another_image_behind_the_same_placeholder_ids_is_not_served_the_first_ones_kv(
        tmp_path, monkeypatch):
    llm_args = store_llm_args(tmp_path, monkeypatch)
    tokens = prompt(4, 1) + [1000] * 12 + prompt(8, 2)  # image placeholders at 4..15
    assert _run_image(llm_args, 1, tokens, image=111) == (0, False)
    assert _run_image(llm_args, 2, tokens, image=222) == (0, False)  # other image: other KV
    assert _run_image(llm_args, 3, tokens, image=111) == (20, False)  # the same image: a hit


def test_a_multimodal_request_without_hashes_shares_no_blocks(tmp_path, monkeypatch):
    llm_args = store_llm_args(tmp_path, monkeypatch)
    tokens = prompt(24, 3)
    for rid in (1, 2):
        sched, worker, ex = _engine(llm_args)
        try:
            ex.add(rid, tokens).multimodal_positions = [0]  # media, but no hashes computed
            ex.run()
            assert matched(ex)[rid] == (0, False)
        finally:
            sched.close()
            worker.close()


class _FailingForward(Executor):
    """TensorRT-LLM's ``_forward_step``: a forward that raises skips ``wait_for_save``;
    ``_handle_errors`` then ends every active request (``request_finished``: held blocks stay
    with the connector until ``get_finished`` reports them) before ``get_finished``."""

    fail_at_step = 1

    def _forward(self, batch) -> None:
        if self.step_no == self.fail_at_step:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        super()._forward(batch)

    def step(self) -> None:
        try:
            super().step()
        except RuntimeError:
            for req in [r for r in self.requests.values() if r.state not in ("done", "saving")]:
                req.state = "done"
                self._end(req, self.scheduler.request_finished(req, list(req.block_ids)))
            self._get_finished()


def test_a_request_ended_by_a_failed_forward_is_reported_saved_and_its_blocks_come_back(tmp_path, monkeypatch):
    llm_args = store_llm_args(tmp_path, monkeypatch)
    sched, worker, ex = _engine(llm_args, _FailingForward)
    try:
        ex.add(1, PROMPTS[3])  # 24 tokens, prefilled in the step that fails
        ex.run(max_steps=20)  # landed code: held for ever ("executor made no progress")
        assert [e[1] for e in ex.log if e[2] == 1] == ["matched", "saved"]
        assert sorted(ex.free) == list(range(ex.pool.shape[0]))  # every block is the engine's again
    finally:
        sched.close()
        worker.close()
    # nothing computed in the failed step was stored: a new engine matches nothing of it
    sched, worker, ex = _engine(llm_args)
    try:
        ex.add(2, PROMPTS[3])
        ex.run()
        assert matched(ex)[2] == (0, False)
    finally:
        sched.close()
        worker.close()



def test_a_vllm_engine_on_the_same_model_never_gets_trtllms_head_major_pages(tmp_path):
    """TensorRT-LLM's attention keeps a block head-major ([K/V, heads, tokens, dim]); the worker
    copies its pages as they are. Its namespace said the canonical layout, so a vLLM engine on
    the same model (equal namespace) loaded them with heads and tokens transposed."""
    from tests.integrations.test_identity import local_model, vllm_ns
    from tests.integrations.trtllm_executor import KvCacheConfig, LlmArgs
    from tiered_kv.integrations.common import parse_settings
    from tiered_kv.integrations.trtllm import trtllm_namespace

    model = local_model(tmp_path)
    config = parse_settings({}, source="x", environ={}).config
    trt = trtllm_namespace(LlmArgs(model=str(model), kv_cache_config=KvCacheConfig()), config)
    assert trt.block_shape == vllm_ns(model).block_shape and trt.revision == vllm_ns(model).revision
    assert trt.digest() != vllm_ns(model).digest()
    flashinfer = LlmArgs(model=str(model), kv_cache_config=KvCacheConfig())
    flashinfer.attn_backend = "FLASHINFER"  # another attention backend: its own pages
    assert trtllm_namespace(flashinfer, config).digest() != trt.digest()
