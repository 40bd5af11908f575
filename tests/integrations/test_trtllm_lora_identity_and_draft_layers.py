"""TensorRT-LLM: a LoRA request is keyed by what names its adapter's weights (its files), never
by the task id alone; and a KV pool holding one-model speculative decoding's draft layers is
refused at registration by name."""

from __future__ import annotations

import itertools
import logging
from types import SimpleNamespace

import pytest
import torch

from tests.integrations.test_trtllm import prompt
from tests.integrations.test_trtllm_requests import _serve
from tests.integrations.trtllm_executor import (
    BS,
    DIM,
    HEADS,
    LAYERS,
    KvCacheLayout,
    LlmRequest,
    store_llm_args,
)
from tiered_kv.errors import ConfigError
from tiered_kv.integrations.trtllm import TieredKVWorker
from tiered_kv.integrations.trtllm_requests import request_view

_task_ids = itertools.count(91_000)  # a task id per test: the adapter memo and warnings are per process


@pytest.fixture
def llm_args(tmp_path, monkeypatch):
    return store_llm_args(tmp_path, monkeypatch)


def _adapter(directory, weights: bytes) -> str:
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text('{"r": 8}')
    (directory / "adapter_model.safetensors").write_bytes(weights)
    return str(directory)


def test_regression_two_engines_with_other_adapters_under_one_task_id_shared_blocks(llm_args, caplog):
    """A request handing only its task id (its adapter sent as tensors, or loaded earlier) was
    keyed by that id alone: a restart, or another replica on the same store, that loaded other
    weights under that id was promised the first one's KV. Nothing names the weights, so neither
    request is loaded or saved; one warning names the task id, not one per request."""
    task, tokens = next(_task_ids), prompt(24, 41)
    with caplog.at_level(logging.WARNING, logger="tiered_kv.integrations.trtllm_requests"):
        first = _serve(llm_args, 1, tokens, lora_task_id=task, lora_weights="weights A")
        second = _serve(llm_args, 2, tokens, lora_task_id=task)  # a restart: adapter loaded as tensors before
    assert first[1:] == ((0, False), 0, 1)  # nothing matched, nothing stored, counted
    assert second[1:] == ((0, False), 0, 1)  # never served the first engine's KV
    warnings = [r.getMessage() for r in caplog.records if f"LoRA task {task}" in r.getMessage()]
    assert len(warnings) == 1 and "lora_path" in warnings[0]


def test_regression_weights_sent_as_tensors_reused_the_files_another_request_loaded_that_id_from(tmp_path):
    """A task id once loaded from files was taken to name those files for every later request of
    it, even one carrying weights of its own: the tensors' KV was keyed as the files'."""
    task = next(_task_ids)
    loaded = LlmRequest(1, prompt(8, 1), 8, 1)
    loaded.lora_task_id, loaded.py_lora_path = task, _adapter(tmp_path / "a", b"A" * 64)
    assert "lora_files=files-" in request_view(loaded).key_extra
    later = LlmRequest(2, prompt(8, 1), 8, 1)
    later.lora_task_id = task
    assert request_view(later).key_extra == request_view(loaded).key_extra  # (the adapter loaded then)
    later.lora_weights = "other weights, as tensors"
    assert request_view(later) is None


def test_a_lora_path_that_holds_no_weight_files_is_no_name_for_the_adapter(tmp_path):
    req = LlmRequest(1, prompt(8, 1), 8, 1)
    req.lora_task_id, req.py_lora_path = next(_task_ids), str(tmp_path / "missing")
    assert request_view(req) is None


def test_adapters_at_other_paths_under_one_task_id_get_other_keys_and_each_is_served_again(llm_args, tmp_path):
    """TensorRT-LLM's LLM API sets ``py_lora_path`` on every request of a ``LoRARequest``: each
    engine names its adapter by its files (two replicas with other weights under one id)."""
    task, tokens = next(_task_ids), prompt(24, 42)
    a, b = _adapter(tmp_path / "a", b"A" * 64), _adapter(tmp_path / "b", b"B" * 64)
    assert _serve(llm_args, 1, tokens, lora_task_id=task, py_lora_path=a)[1] == (0, False)
    assert _serve(llm_args, 2, tokens, lora_task_id=task, py_lora_path=b)[1] == (0, False)  # other weights
    assert _serve(llm_args, 3, tokens, lora_task_id=task, py_lora_path=a)[1][0] == 20  # its own KV


@pytest.mark.parametrize("spec", [SimpleNamespace(decoding_type="MTP", num_nextn_predict_layers=1),
                                  SimpleNamespace(decoding_type="Eagle3", eagle3_one_model=True)])
@pytest.mark.parametrize("v2", [False, True])
def test_regression_a_pool_with_draft_layers_was_refused_without_saying_why(llm_args, spec, v2):
    """One-model speculative decoding (MTP, EAGLE3 one-model) keeps its draft layers in the
    target's KV pool: the pool was refused as an "unsupported KV layout" naming shapes only. The
    refusal names the draft layers, the speculative config and what to do."""
    llm_args.speculative_config = spec
    worker = TieredKVWorker(llm_args)
    try:
        pool = torch.zeros(16, LAYERS + 1, 2, BS * HEADS * DIM)
        with pytest.raises(ConfigError) as err:
            worker.register_kv_cache_layout(KvCacheLayout(pool)) if v2 else worker.register_kv_caches(pool)
        message = str(err.value)
        assert "1 more are draft layers of one-model speculative decoding" in message
        assert spec.decoding_type in message and "without that speculative_config" in message
        assert "\n" not in message
        worker.register_kv_caches(torch.zeros(16, LAYERS, 2, BS * HEADS * DIM))  # the model's layers: taken
    finally:
        worker.close()
