"""Continuous batching with chunked prefill, and the scheduler half of the connector calls.

Each step spends a token budget (``max_num_batched_tokens``) on, in order: one token for every
decoding request, the next prefill chunk of admitted requests, then new requests (FCFS). A new
request is admitted only when the pool can hold it to completion (no preemption). On admission the
connector is asked for external tokens, blocks are allocated, and the connector is told which.
A step's work is a :class:`~tiered_kv.engine.batch.ScheduledBatch`.

With KV cache groups (MLA, hybrid) every block-id argument the connector gets holds one list per
group: a token group's list is the block table, a state group's is the request's state slot.
A model with recurrent state and a connector prefills in chunks that end on block boundaries
(``align``): the state at a block boundary exists only at the end of a step, so each chunk but a
prompt's last ends on one (or, when the step's budget left is under a block, short of the next
one, which the chunk after it then ends on), and a prompt's last full block boundary before its last token is
always the end of a step (a later request can resume there).
"""

from __future__ import annotations

import logging
import time
from collections import deque

from tiered_kv.engine.batch import ScheduledBatch
from tiered_kv.engine.config import EngineConfig
from tiered_kv.engine.connector_api import ConnectorScheduler, RequestData, SchedulerOutput
from tiered_kv.engine.kv_cache_manager import KVCacheManager
from tiered_kv.engine.sequence import RequestStatus, Sequence
from tiered_kv.kv_groups import KVGroup

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager,
                 connector: ConnectorScheduler | None = None, *, groups: tuple[KVGroup, ...] = (),
                 align: bool = False) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.connector = connector
        self.groups = groups  # the namespace's KV cache groups (block ids go per group)
        self.align = align  # prefill chunks end on block boundaries (state at every step end)
        self.block_size = config.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: dict[str, Sequence] = {}  # async loads in flight
        self._finished_since_output: list[str] = []
        self.clock = time.monotonic  # load deadlines (``load_timeout_s``) are read on it

    def add_request(self, request: Sequence) -> None:
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        for request in self.running:  # decodes first
            if not request.is_prefill and budget > 0:
                batch.add(request, request.num_tokens - request.num_computed_tokens)
                budget -= batch.num_scheduled_tokens[request.request_id]
        for request in self.running:  # then prefill chunks of admitted requests
            if request.is_prefill and budget > 0:
                chunk = self._chunk(request, request.num_computed_tokens, budget)
                if chunk:
                    batch.add(request, chunk)
                    budget -= chunk
        budget = self._admit(batch, budget)
        self.kv.prepare_resources(batch)
        if self.connector is not None:
            for request in batch.new_requests:
                self.connector.update_state_after_alloc(self.view(request), self.block_ids(request),
                                                        request.num_external_tokens)
        for request in batch.new_requests:
            if request.num_external_tokens:
                first = request.num_cached_tokens // self.block_size
                last = (request.num_cached_tokens + request.num_external_tokens) // self.block_size
                request.pending_load_blocks = request.block_ids[first:last]
                if not request.load_async:  # a sync load is done before the forward reads it
                    request.num_computed_tokens += request.num_external_tokens
        return batch

    def _chunk(self, request: Sequence, start: int, budget: int) -> int:
        """Prompt tokens from ``start`` to compute in this step (``align``: see the module doc)."""
        end = min(start + budget, request.num_tokens)
        if self.align:
            bs = self.block_size
            boundary = (request.num_prompt_tokens - 1) // bs * bs  # the last a later request resumes at
            if start < boundary < end:
                end = boundary
            elif end < request.num_tokens and end - end % bs > start:
                end -= end % bs
            # else a budget under a block (decodes took some): the chunk ends inside this block and
            # the next one ends on its boundary (no boundary is skipped; prefills are never held back)
        return max(0, end - start)

    def _admit(self, batch: ScheduledBatch, budget: int) -> int:
        available = self.kv.get_num_available_blocks()
        slots = self.kv.get_num_free_slots()
        while self.waiting and budget > 0:
            if len(self.running) + len(self.loading) >= self.config.max_num_seqs or slots == 0:
                break
            request = self.waiting[0]
            cached = self.kv.get_cached_blocks(request)
            num_cached = len(cached) * self.block_size
            num_external, load_async = self._match(request, num_cached)
            need = self.kv.get_num_blocks_to_admit(request, cached)
            chunk = 0 if load_async else self._chunk(request, num_cached + num_external, budget)
            if need > available or (chunk == 0 and not load_async):
                break
            available -= need
            if slots is not None:
                slots -= 1
            self.waiting.popleft()
            request.num_cached_tokens = num_cached
            request.num_external_tokens = num_external
            request.load_async = load_async
            request.num_computed_tokens = num_cached  # external tokens count once allocated
            batch.new_requests.append(request)
            batch.cached_blocks[request.request_id] = cached
            if load_async:
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                timeout = self.config.load_timeout_s
                request.load_deadline = None if timeout is None else self.clock() + timeout
                self.loading[request.request_id] = request
            else:
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                batch.add(request, chunk)
                budget -= chunk
            logger.debug("admitted %s: %d device-cached, %d external (%s) of %d prompt tokens",
                         request.request_id, num_cached, num_external,
                         "async" if load_async else "sync", request.num_prompt_tokens)
        return budget

    def _match(self, request: Sequence, num_cached: int) -> tuple[int, bool]:
        """External tokens after the device hit, capped below the last prompt token, block-aligned."""
        if self.connector is None:
            return 0, False
        matched, load_async = self.connector.get_num_new_matched_tokens(self.view(request), num_cached)
        matched = max(0, int(matched or 0))
        end = min(num_cached + matched, request.num_prompt_tokens - 1)
        end -= end % self.block_size
        num_external = max(0, end - num_cached)
        if self.kv.has_state and num_external != matched:
            num_external = 0  # the state is held where the connector's match ends, not before
        if num_external != matched and matched:
            logger.debug("%s: connector matched %d tokens, using %d", request.request_id, matched, num_external)
        return num_external, bool(load_async) and num_external > 0

    # ---- connector view of the step ------------------------------------------------------------
    def block_ids(self, request: Sequence, first: int = 0, new: bool = True) -> list[int] | tuple[list[int], ...]:
        """The request's block ids from block ``first`` on, as the connector gets them: a list,
        or with groups a tuple of one list per group (a state group: ``[slot]`` when ``new`` and
        the request holds one, else ``[]``)."""
        if not self.groups:
            return list(request.block_ids[first:])
        slot = self.kv.state_slot(request.request_id) if self.kv.has_state else None  # type: ignore[attr-defined]
        return tuple(([slot] if new and slot is not None else []) if g.is_state else list(request.block_ids[first:])
                     for g in self.groups)

    def view(self, request: Sequence):
        """The request as the connector sees it (block ids per group with groups)."""
        return request.view(block_ids=self.block_ids(request) if self.groups else None)

    def build_scheduler_output(self, batch: ScheduledBatch) -> SchedulerOutput:
        new, cached = [], []
        for request in batch.new_requests:
            new.append(RequestData(
                request_id=request.request_id,
                new_tokens=tuple(request.prompt_token_ids),
                new_block_ids=_frozen(self.block_ids(request)),
                computed_position=request.num_cached_tokens,
                num_scheduled_tokens=batch.num_scheduled_tokens.get(request.request_id, 0),
            ))
            request.num_reported_tokens = request.num_prompt_tokens
            request.num_reported_blocks = len(request.block_ids)
            request.reported_new = True
        is_new = {r.request_id for r in batch.new_requests}
        for request in batch.requests:
            if request.request_id in is_new:
                continue
            cached.append(RequestData(
                request_id=request.request_id,
                new_tokens=tuple(request.token_ids[request.num_reported_tokens:]),
                new_block_ids=_frozen(self.block_ids(request, request.num_reported_blocks, new=False)),
                computed_position=request.num_computed_tokens,
                num_scheduled_tokens=batch.num_scheduled_tokens[request.request_id],
            ))
            request.num_reported_tokens = request.num_tokens
            request.num_reported_blocks = len(request.block_ids)
        finished, self._finished_since_output = tuple(self._finished_since_output), []
        return SchedulerOutput(new_requests=tuple(new), cached_requests=tuple(cached),
                               finished_req_ids=finished)

    # ---- transitions ---------------------------------------------------------------------------
    def finish(self, request: Sequence) -> None:
        request.status = RequestStatus.FINISHED
        if request in self.running:
            self.running.remove(request)
        self.loading.pop(request.request_id, None)
        self._finished_since_output.append(request.request_id)

    def overdue_loads(self) -> list[Sequence]:
        """Requests whose async load is past its deadline (``load_timeout_s``)."""
        if not self.loading:
            return []
        now = self.clock()
        return [r for r in self.loading.values() if r.load_deadline is not None and r.load_deadline <= now]

    def loaded(self, request: Sequence) -> None:
        """An async load finished (and was validated) or was given up on: compute the rest of the
        prompt next."""
        if self.loading.pop(request.request_id, None) is None:
            return
        request.status = RequestStatus.RUNNING
        self.running.append(request)


def _frozen(block_ids: list[int] | tuple[list[int], ...]) -> tuple:
    """A RequestData's block ids: a tuple of ids, or with groups a tuple of one list per group."""
    return tuple(block_ids)
