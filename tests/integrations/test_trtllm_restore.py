"""The TensorRT-LLM adapter under the cost-aware restore policy: it reads a lower tier's
matched blocks in the scheduler half (validated into host slots) and its worker copies host
slots, so the lower tier's restores are observed there, and they add up with the prefill."""

from __future__ import annotations

import json

import pytest

from tests.integrations.test_trtllm import PROMPTS
from tests.integrations.trtllm_executor import Executor, KvCacheConfig, LlmArgs, store_llm_args
from tiered_kv.integrations.trtllm import TieredKVScheduler, TieredKVWorker

pytestmark = pytest.mark.restore_cost  # the policy decides from the estimates (not "always")


def _engine(llm_args):
    sched, worker = TieredKVScheduler(llm_args), TieredKVWorker(llm_args)
    return sched, worker, Executor(sched, worker)


def test_reads_from_the_disk_in_the_scheduler_teach_the_disk_restore_estimate(tmp_path, monkeypatch):
    """The adapter reads a lower tier's matched blocks in the scheduler half; its worker copies
    host slots. The disk's restores were never observed: its estimate stayed below the floor and
    the cost policy never weighed a disk load against recomputing (it loaded everything)."""
    llm_args = store_llm_args(tmp_path, monkeypatch)
    prompts = {1: PROMPTS[1], 2: PROMPTS[3]}
    # (loading whatever it costs meanwhile: on a busy machine the estimates learned from the
    # second engine's reads could skip the third's, which then observed none)
    monkeypatch.setenv("TIERED_KV_RESTORE_POLICY", "always")
    for _ in range(3):  # the first engine stores; each later one reads both prompts from the disk
        sched, worker, ex = _engine(llm_args)
        try:
            for rid, p in prompts.items():
                ex.add(rid, p)
            ex.run()
        finally:
            sched.close()
            worker.close()
    monkeypatch.delenv("TIERED_KV_RESTORE_POLICY")
    sched, worker, ex = _engine(llm_args)
    try:
        assert sched.store.costs.restores_observed().get("disk") == 4  # kept in the namespace record
        sched.store.costs.set_prefill(per_step_s=10.0, per_token_s=1.0)  # recomputing: very slow
        req = ex.add(3, PROMPTS[1])
        assert sched.get_num_new_matched_tokens(req, 0) == (28, False)
        assert sched.core._decisions[3].reason == "load_is_faster"  # weighed, not below the floor
        sched.request_finished(req, [])
    finally:
        sched.close()
        worker.close()


def test_a_disk_claim_is_not_predicted_to_overlap_the_prefill(tmp_path, monkeypatch):
    """Blocks of 8 layers (8 frames) from a disk answering in 0.135 s against a 0.139 s prefill
    (0.011 s left after the claim): overlapped frame by frame it would take 0.136 s and load; but
    the disk is read before the step, so it takes 0.146 s: nothing is claimed."""
    store_llm_args(tmp_path, monkeypatch)
    monkeypatch.setenv("TIERED_KV_HOST_CAPACITY", "64MiB")
    model = tmp_path / "big"
    model.mkdir()
    model.joinpath("config.json").write_text(json.dumps({
        "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_size": 1024, "torch_dtype": "float16"}))
    sched = TieredKVScheduler(LlmArgs(model=str(model), kv_cache_config=KvCacheConfig(tokens_per_block=16)))
    try:
        policy = sched.core.restore
        policy.costs.set_prefill(per_step_s=0.01, per_token_s=1e-3)
        policy.costs.set_restore("disk", latency_s=0.135, bytes_per_s=10e12)
        decision = policy.decide(8, lambda: ["disk"] * 8, 0, 8 * 16 + 1)
        assert decision.load_blocks == 0 and decision.load_all_s == pytest.approx(0.135 + 0.011, abs=1e-3)
        assert policy.decide(8, lambda: ["host"] * 8, 0, 8 * 16 + 1).load_blocks == 8  # host slots stream
    finally:
        sched.close()
