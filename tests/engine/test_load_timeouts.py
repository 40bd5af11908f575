"""Async loads the connector does not report in time (``EngineConfig.load_timeout_s``): the
request computes those tokens on fresh blocks (and, for a hybrid, a fresh state slot), and what the
late load writes lands only in the blocks it was given, which no other request gets until the load
is reported. Deadlines are read on the scheduler's clock, set by hand here."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import make_engine, random_prompt
from tests.engine.memory_connector import MemoryConnector
from tests.engine.test_group_store import BS, HYBRID, connector, recomputed
from tests.engine.test_load_edge_cases import NAMESPACE, PARAMS, PROMPT, run, saved_store
from tiered_kv.engine import EngineConfig, SamplingParams
from tiered_kv.engine.sequence import RequestStatus
from tiered_kv.errors import ConfigError
from tiered_kv.keys import block_keys

NEVER = 10**9  # polls: a load the connector does not report unless a test lets it


def step_until_done(engine, request_id: str, max_steps: int = 200):
    for _ in range(max_steps):
        for out in engine.step():
            if out.request_id == request_id:
                return out
    raise AssertionError("the engine stopped making progress")


def report_now(conn: MemoryConnector, request_id: str) -> None:
    conn._loading[request_id] = 1  # the next get_finished completes (and writes) the load


def test_an_async_load_never_reported_does_not_stall_its_request():
    store, [reference] = saved_store()
    conn = MemoryConnector(NAMESPACE, store, load_async=True, load_delay=NEVER, save=False)
    engine = make_engine(connector=conn, load_timeout_s=0)
    request_id = engine.add_request(PROMPT, PARAMS)
    engine.step()  # admitted; not reported at the first poll: given up
    request = engine.get_request(request_id)
    assert request.status is RequestStatus.RUNNING
    loaded_into = [block for _, block in conn._requests[request_id].loads]
    assert len(loaded_into) == 6 and set(loaded_into).isdisjoint(request.block_ids)
    out = step_until_done(engine, request_id)
    assert out.output_token_ids == reference.output_token_ids
    assert (out.num_external_tokens, out.num_prefilled_tokens) == (0, 100)
    kv = engine.kv_cache_manager
    assert engine.load_timeouts.num_blocks == 6 and all(kv.block_manager.ref_counts[b] == 1 for b in loaded_into)
    report_now(conn, request_id)
    engine.step()  # reported at last: the blocks it wrote are free again
    assert engine.load_timeouts.num_blocks == 0 and kv.get_num_free_blocks() == kv.get_max_resource_count()


def test_a_late_load_does_not_write_into_blocks_another_request_owns():
    """The late load writes garbage (its blocks failed) after its request finished and other
    requests filled the pool: none of them reads it."""
    others = [random_prompt(90, seed=40 + i) for i in range(3)]
    store, [reference] = saved_store()
    references = make_engine().generate(others, PARAMS)
    keys = block_keys(NAMESPACE, PROMPT)
    conn = MemoryConnector(NAMESPACE, store, load_async=True, load_delay=NEVER, fail_keys=set(keys[:6]),
                           save=False)
    engine = make_engine(connector=conn, num_blocks=14, load_timeout_s=0)  # two requests at a time
    request_id = engine.add_request(PROMPT, PARAMS)
    assert step_until_done(engine, request_id).output_token_ids == reference.output_token_ids
    ids = [engine.add_request(p, PARAMS) for p in others]
    engine.step()
    report_now(conn, request_id)  # lands while the others run in every block but the 6 set aside
    done = run(engine)
    assert [done[i].output_token_ids for i in ids] == [r.output_token_ids for r in references]
    assert engine.load_timeouts.num_blocks == 0


def test_an_async_load_is_waited_for_until_its_deadline():
    store, [reference] = saved_store()
    conn = MemoryConnector(NAMESPACE, store, load_async=True, load_delay=NEVER, save=False)
    engine = make_engine(connector=conn, load_timeout_s=5.0, enable_prefix_caching=False)
    now = [100.0]
    engine.scheduler.clock = lambda: now[0]
    first = engine.add_request(PROMPT, PARAMS)
    for _ in range(5):
        engine.step()
    assert engine.get_request(first).status is RequestStatus.WAITING_FOR_REMOTE_KVS
    report_now(conn, first)  # in time
    out = run(engine)[first]
    assert out.output_token_ids == reference.output_token_ids
    assert (out.num_external_tokens, out.num_prefilled_tokens) == (96, 4)
    second = engine.add_request(PROMPT, PARAMS)
    engine.step()  # admitted: due at 105
    now[0] += 4.5
    engine.step()
    assert engine.get_request(second).status is RequestStatus.WAITING_FOR_REMOTE_KVS
    now[0] += 0.5
    out = step_until_done(engine, second)  # given up at its deadline
    assert out.output_token_ids == reference.output_token_ids
    assert (out.num_external_tokens, out.num_prefilled_tokens) == (0, 100)
    report_now(conn, second)
    engine.step()
    run(engine)


def test_a_given_up_load_keeps_its_request_id_until_it_is_reported():
    store, _ = saved_store()
    conn = MemoryConnector(NAMESPACE, store, load_async=True, load_delay=NEVER, save=False)
    engine = make_engine(connector=conn, load_timeout_s=0)
    request_id = engine.add_request(PROMPT, PARAMS)
    step_until_done(engine, request_id)
    with pytest.raises(ConfigError, match="already in use"):
        engine.add_request(PROMPT, PARAMS, request_id=request_id)  # its late report would be taken for this one
    report_now(conn, request_id)
    engine.step()
    engine.add_request(PROMPT, PARAMS, request_id=request_id)


@pytest.mark.parametrize("timeout", [-1, float("nan"), float("inf"), True, "5"])
def test_a_bad_load_timeout_is_refused(timeout):
    with pytest.raises(ConfigError, match="load_timeout_s"):
        EngineConfig(load_timeout_s=timeout)


class _Withholding:
    """The real connector, whose worker is told of started loads only once ``release`` is called
    (it then copies them in: a load that completes late)."""

    def __init__(self, inner) -> None:
        self.inner, self.withheld, self.held = inner, [], True

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get_finished(self, finished_req_ids, started_loading_req_ids=()):
        self.withheld += list(started_loading_req_ids)
        started = [] if self.held else self.withheld
        if not self.held:
            self.withheld = []
        return self.inner.get_finished(finished_req_ids, started)


def test_a_late_hybrid_load_does_not_overwrite_the_running_state(tmp_path):
    params = SamplingParams(max_tokens=12, return_logits=True)
    saver = connector(tmp_path, HYBRID)
    try:
        make_engine(HYBRID, connector=saver, block_size=BS).generate([PROMPT], params)
    finally:
        saver.close()
    reference = recomputed(HYBRID, PROMPT, params)
    conn = _Withholding(connector(tmp_path, HYBRID, load_async=True))
    try:
        engine = make_engine(HYBRID, connector=conn, block_size=BS, load_timeout_s=0)
        request_id = engine.add_request(PROMPT, params)
        for _ in range(4):  # given up at the first step; prefilled; decoding
            engine.step()
        assert engine.load_timeouts.num_blocks == 6
        conn.worker._async_loads[request_id].plan.wait()  # read from the store: copied in at the next poll
        conn.held = False  # the load completes now: blocks and state into what was set aside
        out = step_until_done(engine, request_id)
        assert engine.load_timeouts.num_blocks == 0
        # it did write, late: 7 blocks, read from the disk, or from the host tier where the job ran
        # after the recomputed prefill's saves landed there (a loaded CI machine: both are right)
        loaded = conn.worker.load_stats[request_id]
        assert sum(loaded.values()) == 7 and set(loaded) <= {"disk", "host"}, loaded
    finally:
        conn.close()
    assert out.output_token_ids == reference.output_token_ids  # (prefilled in other chunks: float noise)
    assert all(torch.allclose(x, y, rtol=1e-4, atol=1e-4) for x, y in zip(out.logits, reference.logits))
    assert (out.num_external_tokens, out.num_prefilled_tokens) == (0, 100)
