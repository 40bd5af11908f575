"""The scheduler-role connector driven in orders vLLM 0.32 allows beyond the happy path (over the
stand-in engine of ``vllm_engine``): a match whose allocation failed, a request aborted between
its match and its allocation or while its load waits, preemptions, request ids reused once the
old request's blocks went back, prompts an exact multiple of the block size. Afterwards nothing
is left behind (per-request state, leases, held blocks) and every request that ran to its end
produced the output of an engine without the connector (no block counted loaded that was not)."""

from __future__ import annotations

import os
import random
import time

import pytest

from tests.integrations.test_vllm_aborts import AbortingEngine
from tests.integrations.test_vllm_adapter import PROMPTS, Halves, _Null, extra, prompt, run
from tests.integrations.vllm_engine import BS, Blocks, CachedRequestData, Engine, Request, SchedulerOutput


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("TIERED_KV_")]:
        monkeypatch.delenv(name)


def leftovers(halves: Halves) -> dict[str, int]:
    """Per-request state the scheduler side and the store still keep."""
    side = halves.sched._sched
    out = {k: len(getattr(side, k)) for k in ("requests", "reported", "extras", "rekeyed_saves")}
    if side.core is not None:
        out.update({k: len(getattr(side.core, k)) for k in ("_requests", "_matched_from", "_decisions", "_loads")})
    out["leases"] = len(halves.worker._worker.store.loader._leases)
    out["loading"] = len(halves.worker._worker.loading)
    return out


def empty_step() -> SchedulerOutput:
    return SchedulerOutput([], CachedRequestData(), {}, set(), set())


@pytest.mark.parametrize("load_async", [False, True])
def test_thousands_of_requests_aborted_between_match_and_alloc_or_before_their_plan_leave_nothing(
        tmp_path, load_async):
    run(extra(tmp_path), PROMPTS)  # a's blocks are stored
    halves = Halves(extra(tmp_path, load_async=load_async))
    try:
        for i in range(1500):
            req = Request(f"m{i}", PROMPTS["a"], 3)
            n, is_async = halves.sched.get_num_new_matched_tokens(req, 0)
            # (a lower tier answering past lookup_timeout on a busy machine is a miss: 0)
            assert (n, is_async) in ((28, load_async), (0, False))
            if i % 2:  # allocated, then aborted before the step's plan was built
                halves.sched.update_state_after_alloc(req, Blocks(list(range(8))), n)
            assert halves.sched.request_finished(req, []) == (False, None)
            if i % 5 == 0:
                meta = halves.sched.build_connector_meta(empty_step())
                assert not meta.meta.loads and not meta.async_loads  # no load of a finished request
        assert not any(leftovers(halves).values())
    finally:
        halves.close()


def test_a_prompt_an_exact_multiple_of_the_block_size_is_never_claimed_whole(tmp_path):
    p = prompt(8 * BS, 7)
    run(extra(tmp_path), {"x": p})
    halves = Halves(extra(tmp_path))
    try:
        req = Request("y", p, 3)
        assert halves.sched.get_num_new_matched_tokens(req, 0) == (7 * BS, False)  # the last block recomputed
        assert halves.sched.get_num_new_matched_tokens(req, 7 * BS) == (0, False)
        halves.sched.request_finished(req, [])
    finally:
        halves.close()


def reference(req: Request) -> list[int]:
    eng = Engine(_Null(), _Null())
    eng.add("r", req.prompt_token_ids, req.max_tokens)
    return eng.run()["r"]


@pytest.mark.parametrize("load_async", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_aborts_preemptions_failed_allocations_and_reused_ids_keep_outputs_and_leak_nothing(
        tmp_path, load_async, seed):
    rng = random.Random(seed)
    bases = [prompt(n, s) for s, n in enumerate([8, 16, 24, 32])]
    prompts = [b[:cut] + prompt(tail, 100 + i) or prompt(5, i)
               for i, (b, cut, tail) in enumerate((rng.choice(bases), rng.choice([4, 8, 9, 16, 17, 32]),
                                                  rng.choice([0, 1, 3, 4])) for _ in range(10))]
    halves = Halves(extra(tmp_path, load_async=load_async))
    made: list[Request] = []
    try:
        eng = AbortingEngine(halves.sched, halves.worker, budget=rng.choice([7, 64]))
        for _ in range(20000):
            gone = [r for r in (f"r{i}" for i in range(8))
                    if r not in eng.requests or (eng.requests[r].status == "FINISHED" and r not in eng.held)]
            if len(made) < 50 and gone and rng.random() < 0.4:
                rid = rng.choice(gone)  # an id reused once its old request's blocks went back
                eng.requests.pop(rid, None)
                made.append(eng.add(rid, rng.choice(prompts), max_tokens=rng.choice([1, 3, 6])))
            for req in list(eng.waiting):  # matched, then vLLM's allocation failed; maybe aborted then
                if req.status in ("WAITING", "PREEMPTED") and req.num_computed_tokens == 0 and rng.random() < 0.2:
                    halves.sched.get_num_new_matched_tokens(req, 0)
                    if rng.random() < 0.3:
                        eng.abort(req.request_id)
            if eng.running and rng.random() < 0.05:
                eng.preempt_at[eng.steps + 1] = rng.choice(eng.running).request_id
            live = [r for r in eng.requests.values() if r.status != "FINISHED"]
            if live and rng.random() < 0.03:  # aborted anywhere, its load in flight included
                eng.abort(rng.choice(live).request_id)
            computed = eng.computed
            eng.step()
            if eng.computed == computed:
                time.sleep(0.005)  # an idle step waiting on a load (a hang guard, nothing timed)
            if len(made) >= 50 and all(r.status == "FINISHED" for r in eng.requests.values()) and not eng.held:
                break
        assert len(made) == 50 and not eng.held and len(eng.free) == 64
        done = [r for r in made if r.status == "FINISHED" and len(r.output) == r.max_tokens]
        assert done and all(r.output == reference(r) for r in done)
        assert not any(leftovers(halves).values()), leftovers(halves)
    finally:
        halves.close()


def test_regression_an_id_reused_at_once_had_its_running_request_reported_finished_sending(tmp_path):
    """The first request of an id finished unheld (nothing to save); a new request of the same
    id was scheduled in the next step, whose ``finished_req_ids`` named the id for the first. The
    new one's saves planned in that step made the worker report the id in ``finished_sending``:
    vLLM freed the running request's blocks (its ``_free_blocks`` asserts the request finished)."""
    halves = Halves(extra(tmp_path))
    try:
        eng = Engine(halves.sched, halves.worker)
        first = eng.add("r", prompt(BS - 1, 1), max_tokens=1)
        eng.step()  # no full block: finished at once, not held
        assert first.status == "FINISHED" and not eng.held
        again = eng.add("r", PROMPTS["c"], max_tokens=3)  # the id is free again in vLLM
        eng.run(max_steps=200)  # (the engine asserts a request sent was held)
        assert again.output == reference(again)
    finally:
        halves.close()
    second, eng2 = run(extra(tmp_path, lookup_timeout="30s"), {"c": PROMPTS["c"]})  # (no miss on a busy machine)
    assert eng2.requests["c"].num_cached_tokens == 20  # its blocks were saved a step later
