"""A long-running vLLM server: thousands of requests through the adapter's two halves (the
stand-in engine of ``vllm_engine`` with vLLM's abort, ``test_vllm_aborts.AbortingEngine``) in
random orders of the engine's calls: aborts while waiting, while an async load is in flight and
while running, preemptions, requests finished in their first step, ids reused once their
request is gone. Every per-request container of both halves must end bounded by what is live
(nothing, once the engine drained) plus the documented caps, never by the requests served."""

from __future__ import annotations

import os
import random

import pytest

from tests.integrations.test_vllm_aborts import AbortingEngine
from tests.integrations.test_vllm_adapter import Halves, extra
from tiered_kv.connector.meta import ConnectorMeta
from tiered_kv.integrations.vllm import TieredKVMetadata

REQUESTS = 1500
LIVE = 6  # requests holding blocks at once (the stand-in has no allocator limit of its own)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("TIERED_KV_")]:
        monkeypatch.delenv(name)


def _prompt(rng: random.Random) -> list[int]:
    prefix = [1 + (7 * rng.randrange(4) + i) % 97 for i in range(8)]  # 4 shared prefixes: hits
    return prefix + [rng.randrange(1, 999) for _ in range(rng.randrange(1, 9))]


def _sizes(halves: Halves) -> dict[str, int]:
    side, core = halves.sched._sched, halves.sched._sched.core
    worker, wcore = halves.worker._worker, halves.worker._worker.core
    return {"sched.requests": len(side.requests), "sched.reported": len(side.reported),
            "sched.allocated": len(side.allocated), "sched.extras": len(side.extras),
            "sched.rekeyed_saves": len(side.rekeyed_saves), "core._requests": len(core._requests),
            "core._matched_from": len(core._matched_from), "core._decisions": len(core._decisions),
            "core._gone": len(core._gone), "core._loads": len(core._loads),
            "core._suspect": len(core._suspect), "worker.loading": len(worker.loading),
            "worker._async_loads": len(wcore._async_loads), "worker._save_requests": len(wcore._save_requests),
            "worker._finished": len(wcore._finished), "worker.started_loading": len(wcore.started_loading),
            "worker._dropped": len(wcore._dropped),
            "worker._failed_requests": len(wcore._failed_requests), "worker._saves": len(wcore._saves._pending),
            "worker._load_errors": len(wcore._load_errors)}


def test_thousands_of_requests_aborted_preempted_and_reused_leave_no_per_request_state(tmp_path):
    halves = Halves(extra(tmp_path, load_async=True))
    rng = random.Random(52)
    try:
        eng = AbortingEngine(halves.sched, halves.worker, num_blocks=128)
        added = 0
        while added < REQUESTS:
            live = [r for r in eng.requests.values() if r.status != "FINISHED"]
            gone = [rid for rid, r in eng.requests.items() if r.status == "FINISHED" and rid not in eng.held]
            if len(live) + len(eng.held) < LIVE:
                # an id of a request gone for good comes back now and then (clients reuse ids)
                rid = rng.choice(gone) if gone and rng.random() < 0.2 else f"r{added}"
                eng.add(rid, _prompt(rng), max_tokens=rng.choice((1, 1, 2, 4)))
                added += 1
            if live and rng.random() < 0.15:
                eng.abort(rng.choice(live).request_id)  # waiting, loading or running
            running = [r.request_id for r in eng.running]
            if running and rng.random() < 0.1:
                eng.preempt_at[eng.steps + 1] = rng.choice(running)
            eng.step()
            over = {k: n for k, n in _sizes(halves).items() if n > 2 * LIVE}  # live requests, and
            assert not over, over  # those just finished (held, or kept a plan for late reports)
        eng.run(max_steps=eng.steps + 2000)
        for _ in range(4):  # idle steps: what is aged by steps (plans, start_load_kv calls) goes
            eng.step()
        sizes = _sizes(halves)
        assert {k: n for k, n in sizes.items() if n} == {}, sizes
        assert len(halves.worker._worker.core.load_stats) <= 4096
        assert eng.held == set() and len(eng.free) == 128
    finally:
        halves.close()


def test_regression_an_async_load_id_with_no_load_started_stayed_in_loading_for_good(tmp_path):
    """A step's metadata names an async load that the worker's core never started (the
    engine skipped that step's ``start_load_kv``): the id stayed in ``loading`` for the life of
    the process, one more per such step, and a later request of that id that saved was never
    reported in ``finished_sending`` (vLLM held its blocks for good)."""
    halves = Halves(extra(tmp_path, load_async=True))
    connector = halves.worker
    try:
        halves.sched.shutdown()
        connector.register_kv_caches(_caches())
        for i in range(50):
            connector.bind_connector_metadata(TieredKVMetadata(ConnectorMeta(), async_loads=(f"never-{i}",)))
            connector.wait_for_save()  # (no start_load_kv in this step)
            connector.get_finished(set())
            connector.clear_connector_metadata()
            for _ in range(3):  # later steps, loads started as usual
                connector.bind_connector_metadata(TieredKVMetadata(ConnectorMeta()))
                connector.start_load_kv(None)
                connector.wait_for_save()
                connector.get_finished(set())
                connector.clear_connector_metadata()
        assert connector._worker.loading == set()
    finally:
        connector.shutdown()


def _caches() -> dict:
    import torch

    from tests.integrations.vllm_engine import BS, DIM, HEADS, LAYERS

    return {f"model.layers.{i}.attn": torch.zeros(16, 2, BS, HEADS, DIM) for i in range(LAYERS)}
