"""Requests aborted while their async load is in flight, over the stand-in engine of
``vllm_engine`` with vLLM 0.32's abort (``Scheduler.finish_requests``): a request in
WAITING_FOR_REMOTE_KVS whose load was not reported received keeps its blocks until it is, and
vLLM frees them at the first ``finished_sending`` or ``finished_recving`` naming the finished
request (asserting ``req_id in self.requests`` at each). The store's disk reads wait behind the
gate of ``vllm_scenarios_run`` (the load stays in flight). Through the real engine:
``test_vllm_scenarios``."""

from __future__ import annotations

import os
import time

import pytest

from storage_backends.registry import register_backend
from tests.integrations import vllm_scenarios_run
from tests.integrations.test_vllm_adapter import PROMPTS, Halves, extra, run
from tests.integrations.vllm_engine import Engine

GATE = vllm_scenarios_run.GATE


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("TIERED_KV_")]:
        monkeypatch.delenv(name)


@pytest.fixture
def gated(tmp_path):
    """A store holding PROMPTS' blocks, and the extra config of an async engine reading it gated."""
    register_backend("gated", "tests.integrations.vllm_scenarios_run:GatedLmdb")
    run(extra(tmp_path), PROMPTS)
    yield {**extra(tmp_path, load_async=True), "disk": {"url": f"gated://{tmp_path}/db"}}
    GATE.set()


class AbortingEngine(Engine):
    """The stand-in engine with vLLM's abort and its handling of a finished request's reports."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.released: list[str] = []  # finished requests whose blocks went back, in order

    def abort(self, rid: str) -> None:
        req = self.requests[rid]
        receiving = req.status == "WAITING_FOR_REMOTE_KVS" and rid not in self.recving
        for queue in (self.running, self.waiting):
            if req in queue:
                queue.remove(req)
        self.recving.discard(rid)
        req.status = "FINISHED"
        hold, _ = self.sched.request_finished(req, list(req.block_ids))
        self.finished_ids.add(rid)
        if hold or receiving:
            self.held.add(rid)
        else:
            self._release(rid)

    def _release(self, rid: str) -> None:
        self.held.discard(rid)
        self._free(self.requests[rid])
        self.released.append(rid)

    def _update_from_output(self, so, sending, recving, invalid) -> None:
        recving = set(recving)
        for rid in [r for r in recving if self.requests[r].status == "FINISHED"]:  # first, as vLLM
            recving.discard(rid)
            assert rid in self.held, f"{rid} received after its blocks were freed (vLLM: assert req_id in self.requests)"
            self._release(rid)
        super()._update_from_output(so, sending, recving, invalid)  # (asserts a sent request was held)
        self.released += sorted(sending)


def step_until(engine: Engine, done, limit: int = 2000) -> None:
    for _ in range(limit):
        if done():
            return
        computed = engine.computed
        engine.step()
        if engine.computed == computed:
            time.sleep(0.005)  # an idle step waiting on a load
    raise AssertionError("no progress")


def abort_while_its_load_waits(eng, req, rid: str) -> None:
    """Abort ``rid``, whose load waits at the gate: vLLM holds its blocks until the load is
    reported received, then they are released once."""
    assert req.status == "WAITING_FOR_REMOTE_KVS"
    eng.abort(rid)
    for _ in range(3):
        eng.step()
    assert eng.held == {rid} and req.block_ids  # never freed under the load
    GATE.set()
    eng.run(max_steps=400)
    assert eng.released == [rid] and len(eng.free) == 64


def test_a_request_aborted_while_its_load_is_in_flight_is_held_until_received_and_released_once(gated):
    halves = Halves(gated)
    try:
        eng = AbortingEngine(halves.sched, halves.worker)
        GATE.clear()
        req = eng.add("a", PROMPTS["a"], max_tokens=3)
        eng.step()
        abort_while_its_load_waits(eng, req, "a")
    finally:
        GATE.set()
        halves.close()


def test_regression_a_resumed_request_aborted_while_its_load_was_in_flight_was_released_twice(gated):
    """Preempted after its first saves, resumed with an async load from the disk tier (the host
    tier let the blocks go), aborted while that load was in flight: the worker reported the
    earlier saves as ``finished_sending`` at once. vLLM freed the blocks under the load, the load
    was written into them, and its ``finished_recving`` crashed vLLM's scheduler."""
    halves = Halves(gated)
    try:
        eng = AbortingEngine(halves.sched, halves.worker)
        req = eng.add("a", PROMPTS["a"], max_tokens=6)
        step_until(eng, lambda: len(req.output) >= 3)  # its decode filled a block: saved
        eng.preempt_at = {eng.steps + 1: "a"}
        eng.step()
        assert req.status == "PREEMPTED"
        store = halves.worker._worker.store
        assert store.flush(30)
        store.host.delete_many(list(store.host.scan()))  # the host tier let every block go
        GATE.clear()
        eng.step()
        abort_while_its_load_waits(eng, req, "a")
    finally:
        GATE.set()
        halves.close()
