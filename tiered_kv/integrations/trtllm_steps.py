"""How the TensorRT-LLM adapter reads a step's ``SchedulerOutput`` into the core's terms.

TensorRT-LLM's ``KvCacheConnectorSchedulerOutputManager`` keeps, per request id, every token and
block id it listed, and lists only what was appended since (``new_tokens``, ``new_block_ids``);
before ``reset_request`` (``KVCacheManagerV2``) it never forgets a request. A request allocated
anew while that entry lives is listed as *cached*, with deltas against its old allocation: paused
(``_pause_requests``: ``request_finished``, its blocks freed, the generated tokens made prompt) and
scheduled again, its ``new_block_ids`` are the tail of the new block list past the old one's
length and its ``new_tokens`` the tokens sampled after its last listing, already in the new
prompt. Appended, both land at positions that are not theirs, and saves then store a block's KV
under the key of another sequence. So a request's first listing after an allocation
(``update_state_after_alloc``) is read as a new request, with the tokens and blocks it was
allocated with, whichever list carries it.
"""

from __future__ import annotations

from typing import Any

from tiered_kv.integrations.common import RequestStep, StepOutput
from tiered_kv.integrations.trtllm_model import one_group, pages


def core_steps(scheduler_output: Any, allocated: dict, unkeyed: set, beamed: dict) -> StepOutput:
    """``scheduler_output`` in the core's terms. ``allocated``: request -> (device prefix, tokens)
    at its last allocation, taken here at its first listing; ``unkeyed``: requests unknown to the
    core (they only add their tokens to the step's work); ``beamed``: request -> prompt length
    (only the prompt is saved)."""
    for rd in (*scheduler_output.new_requests, *scheduler_output.cached_requests):
        groups = getattr(rd, "new_block_ids_by_layer_group", None)
        if groups is not None and len(groups) > 1:
            one_group(groups, rd.request_id, "build_connector_meta")
        pages(rd.new_block_ids, rd.request_id, "build_connector_meta")
    new, cached = [], []
    for rd in scheduler_output.new_requests:
        rid = rd.request_id
        if rid in unkeyed:
            cached.append(rd)
            continue
        device = allocated.pop(rid, (rd.computed_position,))[0]
        new.append(RequestStep(rid, list(rd.new_tokens)[: beamed.get(rid)], rd.new_block_ids, device,
                               rd.num_scheduled_tokens))
    for rd in scheduler_output.cached_requests:
        rid = rd.request_id
        fresh = allocated.pop(rid, None)
        if fresh is not None:  # deltas against a former allocation: the blocks the core was given stand
            new.append(RequestStep(rid, fresh[1][: beamed.get(rid)], (), fresh[0], rd.num_scheduled_tokens))
        elif rid in beamed:  # (its generated tokens never key a block)
            cached.append(RequestStep(rid, (), rd.new_block_ids, rd.computed_position, rd.num_scheduled_tokens))
        else:
            cached.append(rd)
    return StepOutput(new, cached)
