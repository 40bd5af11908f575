"""A TensorRT-LLM connector half that fails to start after opening its store lets go of it: the
store is closed with its last user, and the next engine of the process opens it afresh."""

from __future__ import annotations

import pytest

import tiered_kv.connector.worker as connector_worker
import tiered_kv.integrations.trtllm as trtllm
from tests.integrations.trtllm_executor import store_llm_args
from tiered_kv.integrations import common
from tiered_kv.integrations.trtllm import TieredKVScheduler, TieredKVWorker


class Refused(RuntimeError):
    pass


def _refuse(*args, **kwargs):
    raise Refused("the connector core could not start")


def _started_and_refused(half, llm_args) -> None:
    """Start ``half``, whose core refuses to start: the shared stores are as they were before."""
    before = dict(common._stores)
    with pytest.raises(Refused):
        half(llm_args)
    assert common._stores == before, "a store nobody uses stays open, its LMDB environment with it"


def test_regression_a_worker_that_failed_to_start_held_its_store_open_for_the_process(tmp_path, monkeypatch):
    llm_args = store_llm_args(tmp_path, monkeypatch)
    monkeypatch.setattr(connector_worker, "ConnectorWorker", _refuse)
    _started_and_refused(TieredKVWorker, llm_args)


def test_regression_a_scheduler_that_failed_to_start_held_its_store_open_for_the_process(tmp_path, monkeypatch):
    llm_args = store_llm_args(tmp_path, monkeypatch)
    monkeypatch.setattr(trtllm, "ConnectorScheduler", _refuse)
    _started_and_refused(TieredKVScheduler, llm_args)
    monkeypatch.undo()
    sched = TieredKVScheduler(store_llm_args(tmp_path, monkeypatch))  # opens afresh, and works
    try:
        assert not sched.store._closed
    finally:
        sched.close()
