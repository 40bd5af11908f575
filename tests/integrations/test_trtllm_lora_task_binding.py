"""TensorRT-LLM keeps the first weights it loaded for a LoRA task id for the life of the process
(``LoraManager.load_from_hf`` skips a uid it holds; an adapter its cache evicted is reloaded from
that memo, never from a request's new path). A request of that task id naming other files is
computed with the first weights, so keyed by its own files it stored KV under the name of an
adapter the engine never loaded: a later process that really loads it was served that KV."""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict

import pytest

import tiered_kv.integrations.trtllm_requests as requests_mod
from tests.integrations.test_trtllm import prompt
from tests.integrations.test_trtllm_requests import _serve
from tests.integrations.trtllm_executor import LlmRequest, store_llm_args
from tiered_kv.fingerprint import PathFingerprints
from tiered_kv.integrations.trtllm_requests import request_view

_task_ids = itertools.count(93_000)
_MANY = 8200  # more task ids than the memos hold


def _new_process(monkeypatch) -> None:
    """What a fresh process knows of LoRA task ids: nothing (and files are stat'ed every time,
    so a rewrite in place is seen at once)."""
    monkeypatch.setattr(requests_mod, "_lora_files", type(requests_mod._lora_files)())
    monkeypatch.setattr(requests_mod, "_lora_refused", type(requests_mod._lora_refused)())
    if hasattr(requests_mod, "_forgotten"):
        monkeypatch.setattr(requests_mod, "_forgotten", bytearray(len(requests_mod._forgotten)))
    monkeypatch.setattr(requests_mod, "LORA_FINGERPRINTS", PathFingerprints(recheck_s=0))


@pytest.fixture
def llm_args(tmp_path, monkeypatch):
    _new_process(monkeypatch)
    return store_llm_args(tmp_path, monkeypatch)


def _adapter(directory, weights: bytes) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text('{"r": 8}')
    (directory / "adapter_model.safetensors").write_bytes(weights)
    return str(directory)


def _view(task, rid: int = 1, **fields):
    req = LlmRequest(rid, prompt(8, 1), 8, 1)
    req.lora_task_id = task
    for name, value in fields.items():
        setattr(req, name, value)
    return request_view(req)


def test_regression_a_second_adapter_path_under_one_task_id_was_keyed_by_files_the_engine_never_loaded(
        llm_args, tmp_path, monkeypatch, caplog):
    task, tokens = next(_task_ids), prompt(24, 51)
    a, b = _adapter(tmp_path / "a", b"A" * 64), _adapter(tmp_path / "b", b"B" * 64)
    first = _serve(llm_args, 1, tokens, lora_task_id=task, py_lora_path=a)
    with caplog.at_level(logging.WARNING, logger="tiered_kv.integrations.trtllm_requests"):
        for rid in (2, 3):  # computed with A's weights, whatever B's path says
            assert _serve(llm_args, rid, tokens, lora_task_id=task, py_lora_path=b)[1:] == ((0, False), first[2], 1)
    warnings = [r.getMessage() for r in caplog.records if f"LoRA task {task}" in r.getMessage()]
    assert len(warnings) == 1 and "first loaded that task id from" in warnings[0]
    assert _serve(llm_args, 4, tokens, lora_task_id=task, py_lora_path=a)[1][0] == 20  # A's own KV still served
    assert _serve(llm_args, 5, tokens, lora_task_id=task)[1][0] == 20  # (a bare task id: the adapter loaded first)
    _new_process(monkeypatch)  # a restart that really loads B under that id
    assert _serve(llm_args, 6, tokens, lora_task_id=task, py_lora_path=b)[1] == (0, False)  # never A's KV


def test_regression_adapter_files_rewritten_in_place_were_keyed_as_the_new_files_while_the_engine_kept_the_old(
        llm_args, tmp_path, monkeypatch):
    task, tokens = next(_task_ids), prompt(24, 52)
    path = _adapter(tmp_path / "adapter", b"old" * 32)
    first = _serve(llm_args, 1, tokens, lora_task_id=task, py_lora_path=path)
    _adapter(tmp_path / "adapter", b"new fine-tune" * 16)  # written over the old one, same path
    assert _serve(llm_args, 2, tokens, lora_task_id=task, py_lora_path=path)[1:] == ((0, False), first[2], 1)
    _new_process(monkeypatch)  # a restart: the engine loads the new files
    assert _serve(llm_args, 3, tokens, lora_task_id=task, py_lora_path=path)[1] == (0, False)


def test_regression_a_task_id_first_sent_as_tensors_was_later_keyed_by_a_path_the_engine_never_loaded(
        llm_args, tmp_path):
    """The engine caches the tensors under the task id and serves a later request of it from that
    cache, whatever path it names."""
    task = next(_task_ids)
    assert _view(task, lora_weights="weights as tensors") is None
    assert _view(task, 2, py_lora_path=_adapter(tmp_path / "b", b"B" * 64)) is None


def test_regression_clearing_the_adapter_memo_at_its_bound_forgot_what_a_task_id_was_first_loaded_from(
        llm_args, tmp_path, monkeypatch):
    monkeypatch.setattr(requests_mod, "LORA_FINGERPRINTS", PathFingerprints())  # (files unchanged: stat'ed seldom)
    task = next(_task_ids)
    a, b = _adapter(tmp_path / "a", b"A" * 64), _adapter(tmp_path / "b", b"B" * 64)
    assert _view(task, py_lora_path=a) is not None
    others = itertools.count(10_000_000)
    for _ in range(_MANY):  # adapters come and go: the memo drops the task id
        assert _view(next(others), py_lora_path=a) is not None
    assert _view(task, 2, py_lora_path=b) is None  # the engine still computes with A
    assert _view(next(others), 3, py_lora_path=b) is not None  # a task id never seen: bound to its files


def test_regression_refusal_warnings_were_remembered_for_every_task_id_forever(llm_args, caplog):
    tasks = [next(_task_ids) for _ in range(_MANY)]
    with caplog.at_level(logging.WARNING, logger="tiered_kv.integrations.trtllm_requests"):
        for task in tasks:
            assert _view(task, lora_weights="tensors") is None
        assert _view(tasks[-1], 2, lora_weights="tensors") is None
    assert len(requests_mod._lora_refused) < _MANY  # bounded
    assert sum(f"LoRA task {tasks[-1]}:" in r.getMessage() for r in caplog.records) == 1  # once per task id
    assert isinstance(requests_mod._lora_files, OrderedDict) and len(requests_mod._lora_files) < _MANY
