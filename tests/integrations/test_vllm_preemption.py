"""Requests preempted between steps, over the stand-in engine of ``vllm_engine``: vLLM 0.32's
``reset_prefix_cache(reset_running_requests=True)`` (and ``pause_scheduler(mode="keep",
clear_cache=True)``) preempts every running request, and the next ``schedule()`` resumes them
and names them in ``preempted_req_ids`` of that same output. (A request preempted within a
step: ``test_vllm_adapter``.)"""

from __future__ import annotations

import os

import pytest

from tests.integrations.test_vllm_adapter import PROMPTS, Halves, extra, run
from tests.integrations.vllm_engine import Engine


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("TIERED_KV_")]:
        monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def reference():
    return run(None, PROMPTS)[0]


@pytest.mark.parametrize("load_async", [False, True])
def test_regression_a_request_resumed_in_the_step_that_names_it_preempted_lost_its_load(
        tmp_path, reference, load_async):
    """The resumed request matched the store and its load was planned; then the same output's
    ``preempted_req_ids`` dropped that load. Sync: vLLM computed on over blocks nobody wrote.
    Async: the request waited for a ``finished_recving`` that never came, its blocks held."""
    run(extra(tmp_path), PROMPTS)  # every prompt's blocks are stored
    halves = Halves(extra(tmp_path, load_async=load_async))
    try:
        eng = Engine(halves.sched, halves.worker)
        for rid, p in PROMPTS.items():
            eng.add(rid, p, max_tokens=3)
        first = eng.run(max_steps=200)
        assert first == reference
        for rid, p in PROMPTS.items():  # the same prompts again, reset while they decode
            eng.add(rid + "2", p, max_tokens=3)
        eng.reset_before = {eng.steps + 3}
        outs = eng.run(max_steps=400)
        assert {rid: outs[rid + "2"] for rid in PROMPTS} == reference
        assert all(eng.requests[rid + "2"].external > 0 for rid in PROMPTS)
    finally:
        halves.close()

