"""A stand-in for vLLM's v1 engine that drives ``TieredKVConnector`` the way vLLM 0.32 does.

What it copies (``v1/core/sched/scheduler.py``, ``v1/worker/kv_connector_model_runner_mixin.py``):

- waiting requests with ``num_computed_tokens == 0`` ask ``get_num_new_matched_tokens(request,
  0)``, get blocks for the prompt, then ``update_state_after_alloc(request, blocks, external)``;
  an async match parks the request in WAITING_FOR_REMOTE_KVS until ``finished_recving`` and
  later calls ``update_state_after_alloc(..., 0)`` again;
- ``SchedulerOutput``: ``scheduled_new_reqs`` (``NewRequestData``: all block ids,
  ``num_computed_tokens`` local + external), ``scheduled_cached_reqs`` (``CachedRequestData``:
  new block ids, ``resumed_req_ids`` with all block ids), ``num_scheduled_tokens``,
  ``finished_req_ids``, ``preempted_req_ids``; token ids are not sent (no pipeline parallel);
- worker: ``bind_connector_metadata`` -> ``start_load_kv`` (before the forward when a sync load
  is in the step, else after) -> ``wait_for_layer_load(layer_name)`` before each layer of a
  forward (``maybe_transfer_kv_layer``) -> ``wait_for_save`` -> ``get_finished(finished_req_ids)`` ->
  ``get_block_ids_with_load_errors`` -> ``clear_connector_metadata``;
- invalid blocks roll ``num_computed_tokens`` back to the first bad block (``recompute``
  policy); ``finished_sending`` frees a held request (asserting vLLM's ``req_id in requests``).

KV caches are per-layer ``[num_blocks, 2, block_size, heads, dim]`` tensors (vLLM 0.32 CPU).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from tests.integrations.trtllm_executor import kv_of

LAYERS, HEADS, DIM, BS = 2, 2, 4, 4
VOCAB = 1000


@dataclass
class FullAttentionSpec:
    block_size: int = BS
    num_kv_heads: int = HEADS
    head_size: int = DIM
    dtype: torch.dtype = torch.float32
    head_size_v: int = DIM
    sliding_window: int | None = None


def vllm_config(extra: dict, *, model: str = "tiny-test-model", device: str = "cpu") -> SimpleNamespace:
    return SimpleNamespace(
        device_config=SimpleNamespace(device_type=device),
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra, is_kv_producer=True),
        model_config=SimpleNamespace(model=model, revision=None),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        load_config=SimpleNamespace(load_format="dummy"))


def kv_cache_config(spec=None, layers: int = LAYERS) -> SimpleNamespace:
    group = SimpleNamespace(kv_cache_spec=spec or FullAttentionSpec(),
                            layer_names=[f"model.layers.{i}.attn" for i in range(layers)])
    return SimpleNamespace(kv_cache_groups=[group])


class Request:
    def __init__(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self._all = list(prompt)
        self.max_tokens = max_tokens
        self.num_computed_tokens = 0
        self.status = "WAITING"
        self.block_ids: list[int] = []
        self.lora_request = None
        self.cache_salt = None
        self.mm_features = []
        self.num_cached_tokens = -1  # vLLM: tokens not computed at first scheduling
        self.external = 0

    @property
    def all_token_ids(self) -> list[int]:
        return list(self._all)

    @property
    def num_tokens(self) -> int:
        return len(self._all)

    @property
    def output(self) -> list[int]:
        return self._all[self.num_prompt_tokens:]


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    kv_connector_metadata: object = None
    has_sync_kv_loads: bool = False


class Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self):
        return (list(self.ids),)


class Engine:
    """Scheduler + one worker in one process (vLLM's uniproc executor)."""

    def __init__(self, scheduler, worker, *, num_blocks: int = 64, budget: int = 64) -> None:
        self.sched, self.worker = scheduler, worker
        self.kv = {f"model.layers.{i}.attn": torch.zeros(num_blocks, 2, BS, HEADS, DIM)
                   for i in range(LAYERS)}
        worker.register_kv_caches(self.kv)
        self.free = list(range(num_blocks))
        self.budget = budget
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished_ids: set[str] = set()
        self.preempted_ids: set[str] = set()
        self.recving: set[str] = set()
        self.held: set[str] = set()
        self.passed_finished: set[str] = set()  # ids passed to the worker in finished_req_ids
        self.prev_step: set[str] = set()
        self.computed = 0
        self.steps = 0
        self.preempt_at: dict[int, str] = {}  # step -> request to preempt (tests)
        # steps before which every running request is preempted, as vLLM's
        # reset_prefix_cache(reset_running_requests=True) does between steps: they may resume in
        # the next schedule(), whose output names them in preempted_req_ids too
        self.reset_before: set[int] = set()

    def add(self, rid: str, prompt: list[int], max_tokens: int = 3) -> Request:
        req = Request(rid, prompt, max_tokens)
        self.requests[rid] = req
        self.waiting.append(req)
        return req

    def _alloc(self, req: Request, upto: int) -> list[int]:
        need = -(-upto // BS) - len(req.block_ids)
        new = [self.free.pop(0) for _ in range(max(0, need))]
        req.block_ids.extend(new)
        return new

    def _free(self, req: Request) -> None:
        self.free.extend(req.block_ids)
        req.block_ids = []

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._free(req)
        req.num_computed_tokens, req.status = 0, "PREEMPTED"
        self.waiting.insert(0, req)
        self.preempted_ids.add(req.request_id)

    def step(self) -> None:
        self.steps += 1
        budget, sched = self.budget, {}
        new_reqs, cached = [], CachedRequestData()
        if self.steps in self.reset_before:
            while self.running:
                self._preempt(self.running[-1])
        victim = self.preempt_at.pop(self.steps, None)
        preempted_here = bool(victim and self.requests[victim] in self.running)
        if preempted_here:
            self._preempt(self.requests[victim])
        for req in list(self.running):  # running requests first, as vLLM does
            n = min(budget, req.num_tokens - req.num_computed_tokens)
            if n <= 0:
                continue
            new = self._alloc(req, req.num_computed_tokens + n)
            cached.req_ids.append(req.request_id)
            cached.new_block_ids.append((new,) if new else None)
            cached.num_computed_tokens.append(req.num_computed_tokens)
            sched[req.request_id], budget = n, budget - n
        has_sync = False
        for req in list(self.waiting):
            if preempted_here:
                break  # vLLM schedules no waiting request in a step that preempted
            if req.status == "WAITING_FOR_REMOTE_KVS":
                if req.request_id not in self.recving:
                    continue
                self.recving.discard(req.request_id)
                req.status = "WAITING"
            external, is_async = 0, False
            if req.num_computed_tokens == 0:
                external, is_async = self.sched.get_num_new_matched_tokens(req, 0)
                assert external < req.num_tokens and not (is_async and external == 0)
            n = min(budget, req.num_tokens - req.num_computed_tokens - external)
            if budget <= 0 or n <= 0 and not is_async:
                break
            self._alloc(req, req.num_computed_tokens + external + (0 if is_async else n))
            self.sched.update_state_after_alloc(req, Blocks(req.block_ids), external)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed_tokens + external
            req.external += external
            if is_async:
                req.status, req.num_computed_tokens = "WAITING_FOR_REMOTE_KVS", external
                continue
            self.waiting.remove(req)
            has_sync |= external > 0
            resumed = req.status == "PREEMPTED"
            req.num_computed_tokens += external
            req.status = "RUNNING"
            self.running.append(req)
            if resumed:
                cached.req_ids.append(req.request_id)
                cached.resumed_req_ids.add(req.request_id)
                cached.new_block_ids.append((list(req.block_ids),))
                cached.num_computed_tokens.append(req.num_computed_tokens)
            else:
                new_reqs.append(NewRequestData(req.request_id, req.prompt_token_ids, (list(req.block_ids),),
                                               req.num_computed_tokens))
            sched[req.request_id], budget = n, budget - n
        so = SchedulerOutput(new_reqs, cached, sched, self.finished_ids, self.preempted_ids,
                             has_sync_kv_loads=has_sync)
        so.kv_connector_metadata = self.sched.build_connector_meta(so)
        self.finished_ids, self.preempted_ids = set(), set()
        for rid, n in sched.items():  # _update_after_schedule
            self.requests[rid].num_computed_tokens += n
        self._execute(so)

    def _execute(self, so: SchedulerOutput) -> None:
        w = self.worker
        w.handle_preemptions(so.kv_connector_metadata)
        w.bind_connector_metadata(so.kv_connector_metadata)
        if so.has_sync_kv_loads:
            w.start_load_kv(None)
        self._forward(so)
        if not so.has_sync_kv_loads:
            w.start_load_kv(None)
        if so.num_scheduled_tokens:  # (vLLM's kv_connector_no_forward runs no wait_for_save)
            w.wait_for_save()
        self.passed_finished |= so.finished_req_ids
        sending, recving = w.get_finished(so.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        self._update_from_output(so, sending or set(), recving or set(), invalid)

    def _forward(self, so: SchedulerOutput) -> None:
        for name, cache in self.kv.items():
            if so.num_scheduled_tokens:  # vLLM's attention wrapper, before each layer of a forward
                self.worker.wait_for_layer_load(name)
            layer = int(name.split(".")[2])
            for rid, n in so.num_scheduled_tokens.items():
                req = self.requests[rid]
                start = req.num_computed_tokens - n
                for pos in range(start, start + n):
                    cache[req.block_ids[pos // BS], :, pos % BS] = kv_of(req.all_token_ids, pos)[layer]
        self.computed += sum(so.num_scheduled_tokens.values())

    def _next_token(self, req: Request) -> int:
        acc = 0
        for pos in range(req.num_tokens):
            b, o = req.block_ids[pos // BS], pos % BS
            total = sum(cache[b, :, o].sum().item() for cache in self.kv.values())
            acc = (acc * 131 + int(total * 100)) % 1_000_000_007
        return 1 + acc % (VOCAB - 1)

    def _update_from_output(self, so, sending: set[str], recving: set[str], invalid: set[int]) -> None:
        rolled_back = set()
        if invalid:  # recompute policy: back to the first bad block among computed ones
            for req in self.running + [r for r in self.waiting if r.status == "WAITING_FOR_REMOTE_KVS"]:
                done = req.num_computed_tokens - so.num_scheduled_tokens.get(req.request_id, 0)
                bad = [i for i, b in enumerate(req.block_ids[: -(-done // BS)]) if b in invalid]
                if bad:
                    req.num_computed_tokens = bad[0] * BS
                    rolled_back.add(req.request_id)
        for rid in so.num_scheduled_tokens:
            req = self.requests[rid]
            if rid in rolled_back or req.num_computed_tokens < req.num_tokens:
                continue
            req._all.append(self._next_token(req))
            if len(req.output) >= req.max_tokens:
                self.running.remove(req)
                req.status = "FINISHED"
                hold, _ = self.sched.request_finished(req, list(req.block_ids))
                self.finished_ids.add(rid)
                if hold:
                    self.held.add(rid)
                else:
                    self._free(req)
        for rid in recving:
            assert rid in self.requests
            self.recving.add(rid)
        for rid in sending:
            assert rid in self.held, f"{rid} reported in finished_sending but not held"
            assert rid in self.passed_finished, f"{rid} reported before it was passed in"
            self.held.discard(rid)
            self._free(self.requests[rid])

    def run(self, max_steps: int = 2000) -> dict[str, list[int]]:
        while any(r.status != "FINISHED" for r in self.requests.values()) or self.held:
            computed = self.computed
            self.step()
            if self.computed == computed:
                time.sleep(0.005)  # an idle engine step waiting on transfers takes real time
            assert self.steps < max_steps, "no progress"
        return {rid: r.output for rid, r in self.requests.items()}
