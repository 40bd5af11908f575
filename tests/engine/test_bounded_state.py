"""A long-running reference engine with the tiered-kv connector over a real store: hundreds of
requests arriving while others run, sharing stored prefixes (sync and async loads), a pool too
small for all of them (requests matched but not admitted yet, matched again later). Every
per-request container of the engine, its scheduler, its block pool and both connector halves must
stay bounded by what is live, and be empty once the engine drained."""

from __future__ import annotations

import random

from tests.engine.test_connector_store_scenarios import ASYNC, LLAMA, connector, prompt
from tiered_kv.engine import EngineConfig, LLMEngine, SamplingParams

REQUESTS = 300
LIVE = 8
ENGINE = EngineConfig(num_blocks=40, max_num_batched_tokens=256)


def _sizes(engine: LLMEngine, conn) -> dict[str, int]:
    core, wcore = conn.scheduler, conn.worker
    kv, sched = engine.kv_cache_manager, engine.scheduler
    return {"engine._requests": len(engine._requests), "engine._held": len(engine._held),
            "engine._load_errors": len(engine._load_errors), "scheduler.loading": len(sched.loading),
            "scheduler.running": len(sched.running), "scheduler.waiting": len(sched.waiting),
            "scheduler._finished_since_output": len(sched._finished_since_output),
            "load_timeouts._aside": len(engine.load_timeouts._aside),
            "sampler._generators": len(engine.sampler._generators), "kv._requests": len(kv._requests),
            "kv._reserved": len(kv._reserved), "core._requests": len(core._requests),
            "core._matched_from": len(core._matched_from), "core._decisions": len(core._decisions),
            "core._gone": len(core._gone), "core._loads": len(core._loads),
            "store leases": len(conn.store.loader._leases), "worker._async_loads": len(wcore._async_loads),
            "worker._save_requests": len(wcore._save_requests), "worker._finished": len(wcore._finished),
            "worker.started_loading": len(wcore.started_loading), "worker._saves": len(wcore._saves._pending),
            "worker._load_errors": len(wcore._load_errors)}


@ASYNC
def test_hundreds_of_requests_through_a_small_pool_leave_no_per_request_state(tmp_path, load_async):
    conn = connector(tmp_path, engine=ENGINE, load_async=load_async)
    engine = LLMEngine(LLAMA, ENGINE, conn, seed=0)
    rng = random.Random(52)
    prefixes = [prompt(48, seed) for seed in range(4)]  # 3 blocks each, shared: hits after the first
    params = SamplingParams(max_tokens=2, temperature=0.0)
    try:
        for i in range(REQUESTS):
            engine.add_request(rng.choice(prefixes) + prompt(rng.randrange(1, 40), 1000 + i), params)
            while engine.has_unfinished_requests() and len(engine._requests) >= LIVE:
                engine.step()
                # the waiting queue is the live requests' (at most LIVE); the rest may hold a
                # plan or a report a step or two after they finished
                over = {k: n for k, n in _sizes(engine, conn).items() if n > 2 * LIVE}
                assert not over, over
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.drain(60.0)
        for _ in range(4):  # idle steps: what is aged by steps goes
            engine.step()
        sizes = _sizes(engine, conn)
        assert {k: n for k, n in sizes.items() if n} == {}, sizes
        assert engine.kv_cache_manager.get_num_available_blocks() == ENGINE.num_blocks
    finally:
        conn.close()

