"""The scheduler half of the vLLM adapter: vLLM's requests and scheduler outputs translated into
the connector core's request views and new/cached request steps (no torch import).

Keys come from token ids (``prompt_token_ids`` / ``all_token_ids``), never vLLM's own
process-seeded block hashes; LoRA, ``cache_salt`` and multimodal hashes are folded in as the
key's extra. A request resumed after preemption is handed to the core as new, with all its blocks.
"""

from __future__ import annotations

import logging
from typing import Any

from tiered_kv.connector.meta import ConnectorMeta
from tiered_kv.connector.scheduler import ConnectorScheduler
from tiered_kv.fingerprint import LORA_FINGERPRINTS
from tiered_kv.integrations.common import RequestStep, RequestView, StepOutput, release_index, scheduler_index
from tiered_kv.integrations.vllm_events import VllmEventTracker
from tiered_kv.integrations.vllm_groups import group_ids
from tiered_kv.keys import Namespace, key_extra

log = logging.getLogger(__name__)


def _key_extra(request: Any) -> str | None:
    """LoRA adapter, tenant salt and multimodal inputs change the KV of the same token ids.

    A LoRA adapter is named by its name, id and a fingerprint of its files (names, sizes,
    mtimes; cached per path, re-checked at most once a second): an adapter replaced under the
    same name and id gets other keys. A ``lora_path`` that is not local here (a hub id the
    worker resolves) has no fingerprint: it is named by that path then (another hub adapter
    under the same name and id got the same keys)."""
    parts = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        path = getattr(lora, "lora_path", None) or getattr(lora, "path", None)
        files = LORA_FINGERPRINTS.get(path) if path else None
        parts.append(("lora", f"{getattr(lora, 'lora_name', '')}:{getattr(lora, 'lora_int_id', '')}"
                      + (f":{files}" if files else f":path={path}" if path else "")))
    if getattr(request, "cache_salt", None):
        parts.append(("salt", request.cache_salt))
    for feature in getattr(request, "mm_features", None) or ():
        ident = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)
        pos = getattr(getattr(feature, "mm_position", None), "offset", "")
        parts.append(("mm", f"{ident}@{pos}"))
    # (joined with a value's ";" escaped: a salt or a caller's media UUID holding ";mm=..." read
    # as another part, so a chosen salt named another tenant's keys)
    return key_extra(parts)


def mm_content_hashed(vllm_config: Any) -> bool:
    """Whether vLLM names multimodal items by a hash of their content. With its processor cache
    (``mm_processor_cache_gb=0``) and its prefix caching both off it names them by a per-process
    counter (``renderer0-mm-1-image-0``): the next run or another replica gives that name to
    another image, so such requests get no keys."""
    mm = getattr(getattr(vllm_config, "model_config", None), "multimodal_config", None)
    prefix_caching = getattr(getattr(vllm_config, "cache_config", None), "enable_prefix_caching", True)
    return not (mm is not None and getattr(mm, "mm_processor_cache_gb", None) == 0 and not prefix_caching)


def group0(block_ids: Any) -> list[int]:
    """The block ids of the single KV cache group (``([ids],)`` in vLLM's outputs)."""
    if not block_ids:
        return []
    return list(block_ids[0])


class SchedulerSide:
    """vLLM's scheduler outputs translated into the core's new/cached request data."""

    def __init__(self, settings, namespace: Namespace, events: VllmEventTracker | None = None,
                 device: str | None = None, mm_keyed: bool = True) -> None:
        self.settings, self.namespace = settings, namespace
        self.mm_keyed = mm_keyed  # vLLM names multimodal items by content (mm_content_hashed)
        self.device = device  # vLLM's device type ("cuda", "cpu"): settles layerwise_loads = "auto"
        self.events = events  # vLLM's KV events are on: planned blocks' vLLM names are kept
        self.index = None  # opened at the first request, when the worker of this process exists
        self.core: ConnectorScheduler | None = None
        self.requests: dict[str, Any] = {}  # live vLLM Request objects (all_token_ids grows)
        self.reported: dict[str, int] = {}  # tokens handed to the core per request
        self.allocated: set[str] = set()  # requests allocated since the last build_connector_meta
        self.extras: dict[str, str | None] = {}  # request -> the key extra its keys were made with
        self.rekeyed_saves: set[str] = set()  # requests re-keyed after saves (held when finished)
        self.matched_tokens = 0  # external tokens promised so far (for reports)
        self.matched_requests = 0
        self.n_groups = len(namespace.groups)

    def _ids(self, block_ids: Any):
        """A step's block ids as the core takes them: group 0's, or every group's (KV groups)."""
        return group_ids(block_ids, self.n_groups) if self.n_groups else group0(block_ids)

    def _core(self) -> ConnectorScheduler:
        if self.core is None:
            self.index = scheduler_index(self.settings.config, self.namespace)
            self.core = ConnectorScheduler(self.index, self.namespace, load_async=self.settings.load_async,
                                           save=self.settings.save, device=self.device)
        return self.core

    def _view(self, request: Any) -> RequestView | None:
        if getattr(request, "prompt_token_ids", None) is None or getattr(request, "prompt_embeds", None) is not None:
            # prompt embeddings (all of the prompt, or mixed with token ids whose places then hold
            # placeholders): the ids do not say what the model read there, so nothing is keyed
            return None
        if not self.mm_keyed and getattr(request, "mm_features", None):
            return None  # its images are named by a counter, not by their content
        return RequestView(request.request_id, list(request.prompt_token_ids), int(request.num_prompt_tokens),
                     _key_extra(request), getattr(request, "cache_salt", None) or None)

    def _rekey(self, view: RequestView) -> None:
        """A streaming-input session (vLLM's resumable requests) keeps its request id while its
        next chunk brings multimodal items: its key extra changes, and so does every key. Its
        keys are made anew then: the old ones named the new chunk's blocks without its images,
        so another session differing only by them was promised KV computed over other images."""
        rid, extra = view.request_id, view.key_extra
        if rid in self.extras and self.extras[rid] != extra and self.core is not None:
            log.info("tiered-kv: request %s: its multimodal inputs or salt changed; keyed anew", rid)
            if self.core.request_finished(view, ()):  # (its saves so far are still reported)
                self.rekeyed_saves.add(rid)
        self.extras[rid] = extra

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        view = self._view(request)
        if view is None:
            return 0, False
        self.requests[view.request_id] = request
        self._rekey(view)
        if getattr(request, "skip_reading_prefix_cache", False):
            # (prompt logprobs): vLLM drops any claim, so none is weighed, counted or probed with
            return 0, False
        n, is_async = self._core().get_num_new_matched_tokens(view, num_computed_tokens)
        return n, bool(is_async and n)

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        view = self._view(request)
        if view is None:
            return
        self.requests[view.request_id] = request
        self._rekey(view)
        self.allocated.add(view.request_id)
        self._core().update_state_after_alloc(view, block_ids, num_external_tokens)
        if num_external_tokens > 0:
            self.matched_tokens += num_external_tokens
            self.matched_requests += 1
            log.info("tiered-kv: request %s: %d tokens from the store", view.request_id, num_external_tokens)

    def build_connector_meta(self, so: Any) -> tuple[ConnectorMeta, tuple[str, ...], tuple[str, ...]]:
        """The core's plan, the requests whose loads are async, and the preempted requests."""
        core = self._core()
        preempted = tuple(getattr(so, "preempted_req_ids", None) or ())
        for rid in preempted:
            # one allocated in this schedule() was preempted before it (vLLM's reset_prefix_cache
            # preempts between steps, and the next step resumes): its new allocation stands
            if rid not in self.allocated:
                core.request_preempted(rid)
        self.allocated.clear()
        # A request id reused at once: the previous request of that id finished unheld, and this
        # step hands its id to the workers in finished_req_ids. A save of the new one planned in
        # this step made the worker report the id in finished_sending, and vLLM freed the new,
        # running request's blocks (asserting it finished). Its first step's saves go out with
        # the next plan (no_save), when finished_req_ids can name only this request.
        reborn = set(getattr(so, "finished_req_ids", None) or ())
        new, cached = [], []
        for nr in so.scheduled_new_reqs:
            request = self.requests.get(nr.req_id)
            if request is None:
                continue  # never matched: prompt embeddings
            tokens = list(request.all_token_ids)
            new.append(RequestStep(nr.req_id, tokens, self._ids(nr.block_ids),
                             nr.num_computed_tokens - core.external_tokens(nr.req_id),
                             so.num_scheduled_tokens.get(nr.req_id, 0), no_save=nr.req_id in reborn))
            self.reported[nr.req_id] = len(tokens)
        cr = so.scheduled_cached_reqs
        resumed = set(getattr(cr, "resumed_req_ids", None) or ())
        legacy = getattr(cr, "resumed_from_preemption", None)  # older vLLM: one bool per request
        for i, rid in enumerate(cr.req_ids):
            request = self.requests.get(rid)
            if request is None:
                continue
            tokens = list(request.all_token_ids)
            scheduled = so.num_scheduled_tokens.get(rid, 0)
            blocks = self._ids(cr.new_block_ids[i])
            if rid in resumed or (legacy is not None and legacy[i]):  # all its blocks are new
                new.append(RequestStep(rid, tokens, blocks, cr.num_computed_tokens[i] - core.external_tokens(rid),
                                 scheduled))
            else:
                cached.append(RequestStep(rid, tokens[self.reported.get(rid, len(tokens)):], blocks,
                                    cr.num_computed_tokens[i], scheduled))
            self.reported[rid] = len(tokens)
        meta = core.build_connector_meta(StepOutput(new, cached))
        if self.events is not None:
            self._remember(meta)
        return meta, tuple(s.request_id for s in meta.loads if s.is_async), preempted

    def _remember(self, meta: ConnectorMeta) -> None:
        """The vLLM names of the blocks this step saves and loads (for the events about them)."""
        for spec in [*meta.saves, *meta.loads, *self.core.held_saves()]:  # (held: may finish first)
            request = self.requests.get(spec.request_id)
            if request is None or not spec.keys:
                continue
            try:
                chain = self.core.keys_of(spec.request_id)
            except KeyError:  # finished meanwhile
                continue
            first = getattr(spec, "first_block", None)
            if first is None:
                first = chain.index(spec.keys[0]) if spec.keys[0] in chain else None
            if first is not None:
                self.events.remember(request, spec.keys, first, chain)

    def request_finished(self, request: Any, block_ids: list[int]) -> bool:
        self.requests.pop(request.request_id, None)
        self.reported.pop(request.request_id, None)
        self.extras.pop(request.request_id, None)
        rekeyed = request.request_id in self.rekeyed_saves
        self.rekeyed_saves.discard(request.request_id)
        if self.core is None:
            return False
        return self.core.request_finished(request, block_ids) or rekeyed

    def close(self) -> None:
        release_index(self.index)
        self.index = None
