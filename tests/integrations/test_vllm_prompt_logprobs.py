"""A request that wants prompt logprobs reads no cache in vLLM (``skip_reading_prefix_cache``):
vLLM calls ``get_num_new_matched_tokens`` and then drops the claim. The connector claims nothing
for it, so the cost policy neither weighs nor counts a restore that cannot happen. (Through the
real engine: ``test_vllm_scenarios``.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.connector.test_restore_policy import BS, DENSE, PROMPT, Index, estimates
from tiered_kv.connector.restore_policy import RestorePolicy
from tiered_kv.connector.scheduler import ConnectorScheduler
from tiered_kv.integrations.common import parse_settings
from tiered_kv.integrations.vllm_scheduler import SchedulerSide

pytestmark = pytest.mark.restore_cost  # the estimates are injected


def vllm_request(rid: str, *, prompt_logprobs: bool):
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(PROMPT), num_prompt_tokens=len(PROMPT),
                           all_token_ids=list(PROMPT), lora_request=None, cache_salt=None, mm_features=[], prompt_embeds=None,
                           skip_reading_prefix_cache=prompt_logprobs)


def side_over(index: Index, probe_every: int = 32) -> SchedulerSide:
    side = SchedulerSide(parse_settings({}, source="test"), DENSE)
    policy = RestorePolicy(index.costs, 32768, BS, probe_every=probe_every, count=index.count_restore_skips)
    side.core = ConnectorScheduler(index, DENSE, restore=policy)
    return side


def test_regression_a_prompt_logprobs_request_was_counted_as_skipping_a_slow_restore():
    """Its eight blocks sit in a tier slower than recomputing: the policy skipped them and counted
    eight ``slower_than_recompute`` misses for a request vLLM would not have loaded anyway."""
    index = Index(DENSE, ["remote"] * 8, estimates())
    side = side_over(index)
    request = vllm_request("r", prompt_logprobs=True)
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    side.update_state_after_alloc(request, list(range(9)), 0)
    assert index.skipped == []


def test_regression_a_prompt_logprobs_request_used_up_the_probe_of_a_slow_tier():
    """Every third would-be skip loads, to measure the slow tier again; a prompt logprobs request
    took that turn (vLLM dropped its claim: nothing was measured) and the next probe was put off."""
    index = Index(DENSE, ["remote"] * 8, estimates())
    side = side_over(index, probe_every=3)
    claims = []
    for i, logprobs in enumerate([False, False, True, False]):
        request = vllm_request(f"r{i}", prompt_logprobs=logprobs)
        n, _ = side.get_num_new_matched_tokens(request, 0)
        side.update_state_after_alloc(request, list(range(9)), 0 if logprobs else n)
        claims.append(n)
    assert claims == [0, 0, 0, 8 * BS]  # the probe goes to the next request that can load


def test_the_blocks_a_prompt_logprobs_request_computes_are_still_saved():
    index = Index(DENSE, ["remote"] * 8, estimates())
    side = side_over(index)
    request = vllm_request("r", prompt_logprobs=True)
    side.get_num_new_matched_tokens(request, 0)
    side.update_state_after_alloc(request, list(range(9)), 0)
    step = SimpleNamespace(preempted_req_ids=set(), num_scheduled_tokens={"r": len(PROMPT)},
                           scheduled_new_reqs=[SimpleNamespace(req_id="r", block_ids=(list(range(9)),),
                                                               num_computed_tokens=0)],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                                                 new_block_ids=[], num_computed_tokens=[]))
    meta, _, _ = side.build_connector_meta(step)
    assert [len(s.keys) for s in meta.saves] == [8]
