"""A request id vLLM reuses at once: the previous request of that id finished unheld, and the step
that schedules the new one names the id in ``finished_req_ids`` for the old one. The new one's
first step plans no save for the workers (they would report the id in ``finished_sending`` and
vLLM would free the new, running request's blocks) but counts its tokens as the step's work, and
its saves go out with the next plan: the blocks are stored after its second step, and a request
that finished within its first step is held until they are (not a miss for the next one).

Over the stand-in engine of ``vllm_engine`` and, for KV groups, the connector core over a real
LMDB store."""

from __future__ import annotations

import os

import pytest

from tests.connector.test_kv_groups import BS as BS_GROUPS
from tests.connector.test_kv_groups import FULL, PROMPT, SLIDING, STATE, connector, namespace
from tests.integrations.test_vllm_adapter import PROMPTS, Halves, extra, prompt, run
from tests.integrations.test_vllm_match_orders import reference
from tests.integrations.vllm_engine import BS, Engine
from tiered_kv.integrations.common import RequestStep, RequestView, StepOutput


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("TIERED_KV_")]:
        monkeypatch.delenv(name)


class RecordingEngine(Engine):
    """Keeps every step's plan and ``finished_sending``."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.metas, self.sent = [], []

    def _execute(self, so) -> None:
        self.metas.append(so.kv_connector_metadata.meta)
        super()._execute(so)

    def _update_from_output(self, so, sending, recving, invalid) -> None:
        self.sent.append(set(sending))
        super()._update_from_output(so, sending, recving, invalid)


def reborn(halves: Halves, max_tokens: int) -> tuple[RecordingEngine, object]:
    """Request "r" finishes unheld (no full block); a new "r" is scheduled in the next step."""
    eng = RecordingEngine(halves.sched, halves.worker)
    first = eng.add("r", prompt(BS - 1, 1), max_tokens=1)
    eng.step()
    assert first.status == "FINISHED" and not eng.held
    again = eng.add("r", PROMPTS["c"], max_tokens=max_tokens)
    eng.step()  # its first step: finished_req_ids names "r" for the first request
    assert eng.passed_finished == {"r"} and "r" not in eng.sent[-1]
    assert not [s for s in eng.metas[-1].saves if s.request_id == "r"]  # no save planned in it
    return eng, again


def test_an_id_reused_at_once_counts_its_first_steps_tokens_as_the_steps_work(tmp_path):
    halves = Halves(extra(tmp_path))
    try:
        eng, again = reborn(halves, max_tokens=3)
        # (the prefill estimate learns from these: 0 tokens timed as a whole forward skewed it)
        assert eng.metas[-1].step_tokens == len(PROMPTS["c"]) and eng.metas[-1].step_attention > 0
        eng.run(max_steps=200)
        assert again.output == reference(again)
    finally:
        halves.close()


def test_an_id_reused_at_once_has_its_first_steps_blocks_stored_after_its_second_step(tmp_path):
    halves = Halves(extra(tmp_path))
    try:
        eng, again = reborn(halves, max_tokens=3)
        core = halves.sched._sched.core
        keys = list(core.keys_of("r"))
        assert len(keys) == len(PROMPTS["c"]) // BS
        eng.step()  # its second step
        assert [(s.first_block, len(s.keys)) for s in eng.metas[-1].saves if s.request_id == "r"] == [(0, 6)]
        assert core.index.lookup(keys) == len(keys)
        eng.run(max_steps=200)
        assert again.output == reference(again) and not eng.held
    finally:
        halves.close()


def test_an_id_reused_at_once_that_finishes_in_its_first_step_is_held_until_its_blocks_are_saved(tmp_path):
    halves = Halves(extra(tmp_path))
    try:
        eng, again = reborn(halves, max_tokens=1)
        assert again.status == "FINISHED" and "r" in eng.held  # its blocks wait for the save
        eng.step()  # finished_req_ids names "r" for this request now: the save goes out, reported
        assert [(s.first_block, len(s.keys)) for s in eng.metas[-1].saves] == [(0, 6)]
        eng.run(max_steps=200)  # (the engine asserts an id sent was held and passed in)
        assert not eng.held and len(eng.free) == 64 and again.output == reference(again)
    finally:
        halves.close()
    _, eng2 = run(extra(tmp_path, lookup_timeout="30s"), {"c": PROMPTS["c"]})  # (no miss on a busy machine)
    assert eng2.requests["c"].num_cached_tokens == 20  # was a miss: nothing of it was saved


# -- KV groups, at the connector core ------------------------------------------------------------
def first_step(tmp_path, groups, ids, scheduled):
    conn = connector(tmp_path, namespace(*groups))
    step = RequestStep("r", list(PROMPT), ids, 0, scheduled, no_save=True)
    meta = conn.scheduler.build_connector_meta(StepOutput([step], []))
    assert not meta.saves and meta.step_tokens == scheduled
    return conn


def second_step(conn, computed):
    return conn.scheduler.build_connector_meta(StepOutput([], [RequestStep("r", [], [[], []], computed, 1)]))


def test_a_reused_id_running_on_with_a_sliding_window_drops_its_first_steps_saves(tmp_path):
    """Blocks behind the window go back to vLLM in the next step (maybe to another request's
    forward before the save reads them): saved then, they could hold another request's KV."""
    conn = first_step(tmp_path, (SLIDING, FULL), [list(range(1, 8)), list(range(8, 15))], len(PROMPT))
    try:
        assert not second_step(conn, len(PROMPT)).saves
        assert conn.request_finished(RequestView("r", list(PROMPT), len(PROMPT), None), []) is False
    finally:
        conn.close()


def test_a_reused_id_running_on_in_a_hybrid_saves_its_first_steps_blocks_without_the_rewritten_state(tmp_path):
    conn = first_step(tmp_path, (FULL, STATE), [list(range(1, 8)), [20]], 6 * BS)
    try:
        [spec] = second_step(conn, 6 * BS).saves
        assert (spec.first_block, len(spec.keys), spec.state_key) == (0, 6, None)
        assert conn.request_finished(RequestView("r", list(PROMPT), len(PROMPT), None), []) is True
    finally:
        conn.close()


def test_a_reused_id_finished_in_its_first_step_saves_its_blocks_and_state_next_step(tmp_path):
    """Its blocks are held by the engine: nothing rewrites them, windowed or not."""
    for sub, groups, ids in [("w", (SLIDING, FULL), [list(range(1, 8)), list(range(8, 15))]),
                             ("s", (FULL, STATE), [list(range(1, 8)), [20]])]:
        conn = first_step(tmp_path / sub, groups, ids, 6 * BS)
        try:
            assert conn.request_finished(RequestView("r", list(PROMPT), len(PROMPT), None), []) is True
            [spec] = conn.scheduler.build_connector_meta(StepOutput([], [])).saves
            assert (spec.request_id, spec.first_block, len(spec.keys)) == ("r", 0, 6)
            assert (spec.state_key is not None) == (STATE in groups)
        finally:
            conn.close()


def test_a_reused_id_preempted_after_its_first_step_saves_nothing_of_it(tmp_path):
    conn = first_step(tmp_path, (FULL, STATE), [list(range(1, 8)), [20]], 6 * BS)
    try:
        conn.scheduler.request_preempted("r")  # its blocks went back to the engine
        assert not conn.scheduler.build_connector_meta(StepOutput([], [])).saves
        assert conn.request_finished(RequestView("r", list(PROMPT), len(PROMPT), None), []) is False
    finally:
        conn.close()


def test_regression_a_reused_id_finishing_in_its_first_step_alone_was_held_for_good(tmp_path):
    # its held save went out with the next plan, which (nothing else running) scheduled no
    # token: vLLM runs such a step without wait_for_save, so the save never reached a worker,
    # the id was never reported and vLLM held the request's blocks for good
    halves = Halves(extra(tmp_path))
    try:
        eng = Engine(halves.sched, halves.worker)
        eng.add("r", prompt(BS - 1, 1), max_tokens=1)
        eng.step()
        assert not eng.held
        again = eng.add("r", PROMPTS["c"], max_tokens=1)
        eng.step()
        assert again.status == "FINISHED" and "r" in eng.held
        for _ in range(50):  # (a hang guard: one idle step reports it)
            eng.step()
            if "r" not in eng.held:
                break
        assert "r" not in eng.held, "held for good: its save never reached a worker"
    finally:
        halves.close()


def test_regression_a_held_save_of_a_finished_request_made_a_newer_one_under_its_id_held_too(tmp_path):
    # the release set had_saves on whatever request had the id by then: a third request under
    # it, which planned no save, was held by vLLM and never reported (its blocks held for good)
    conn = connector(tmp_path, namespace(FULL))
    sched = conn.scheduler
    try:
        first = RequestView("r", list(PROMPT), len(PROMPT), None)
        sched.get_num_new_matched_tokens(first, 0)
        sched.update_state_after_alloc(first, [[1, 2, 3, 4, 5, 6, 7]], 0)
        plan = sched.build_connector_meta(StepOutput(
            [RequestStep("r", list(PROMPT), [[1, 2, 3, 4, 5, 6, 7]], 0, len(PROMPT), no_save=True)], []))
        assert not plan.saves
        assert conn.request_finished(first, []) is True  # held for its held saves
        short = list(range(900, 900 + BS_GROUPS - 1))
        newer = RequestView("r", short, len(short), None)
        sched.get_num_new_matched_tokens(newer, 0)
        sched.update_state_after_alloc(newer, [[9]], 0)
        plan = sched.build_connector_meta(StepOutput([RequestStep("r", short, [[9]], 0, len(short), no_save=True)], []))
        assert [s.request_id for s in plan.saves] == ["r"]  # the first one's
        assert conn.request_finished(newer, []) is False  # it planned nothing to save
    finally:
        conn.close()
