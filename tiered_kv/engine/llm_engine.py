"""The reference engine: requests in, tokens out, with an optional KV connector.

One :meth:`LLMEngine.step` follows TensorRT-LLM's executor order (see
:mod:`tiered_kv.engine.connector_api`): schedule (matched tokens, allocation,
``update_state_after_alloc``) -> ``build_connector_meta`` -> ``bind_connector_meta`` ->
``start_load_kv`` -> forward with per-layer hooks -> ``wait_for_save`` -> sample ->
``request_finished`` -> ``get_finished``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import fields, replace
from pathlib import Path

import torch

from tiered_kv.engine.batch import ScheduledBatch
from tiered_kv.engine.cached_sequence import CachedSequenceInterface
from tiered_kv.engine.config import EngineConfig, ModelConfig
from tiered_kv.engine.connector_api import ConnectorScheduler, ConnectorWorker
from tiered_kv.engine.load_timeouts import LoadTimeouts
from tiered_kv.engine.model_runner import ModelRunner, resolve_device
from tiered_kv.engine.namespace import engine_namespace, weights_revision
from tiered_kv.engine.output import Output
from tiered_kv.engine.sampler import Sampler
from tiered_kv.engine.sampling_params import SamplingParams
from tiered_kv.engine.scheduler import Scheduler
from tiered_kv.engine.sequence import RequestStatus, Sequence
from tiered_kv.engine.weights import load_pretrained, read_config, seeded_model
from tiered_kv.errors import ConfigError
from tiered_kv.keys import KeyChain, Namespace

logger = logging.getLogger(__name__)


def _split_connector(connector: object) -> tuple[ConnectorScheduler | None, ConnectorWorker | None]:
    if connector is None:
        return None, None
    if isinstance(connector, tuple):
        scheduler_half, worker_half = connector
        return scheduler_half, worker_half
    return connector, connector  # type: ignore[return-value]


def _namespaces_of(connector: object) -> list:
    """The namespaces a connector (or each half of a pair) keys its blocks in, where it says."""
    found = []
    for part in connector if isinstance(connector, tuple) else (connector,):
        ns = getattr(part, "namespace", None) or getattr(getattr(part, "store", None), "namespace", None)
        if ns is not None:
            found.append(ns)
    return found


class LLMEngine:
    def __init__(self, model_config: ModelConfig | None = None, engine_config: EngineConfig | None = None,
                 connector: object = None, *, seed: int = 0, model_dir: str | Path | None = None) -> None:
        self.engine_config = engine_config = engine_config or EngineConfig()
        self.device = resolve_device(engine_config.device)
        if model_dir is not None:
            on_disk = read_config(model_dir)
            if model_config is not None and replace(on_disk, dtype=model_config.dtype) != model_config:
                raise ConfigError(f"model_config does not match {model_dir}/config.json")
            dtype = model_config.dtype if model_config is not None else None
            self.model = load_pretrained(model_dir, device=self.device, dtype=dtype)
        else:
            self.model = seeded_model(model_config or ModelConfig(), seed, self.device)
        self.model_config = model_config = self.model.config
        self.max_model_len = engine_config.resolved_max_model_len(model_config)
        revision = weights_revision(model_config, seed=seed, model_dir=model_dir)
        self.namespace = engine_namespace(model_config, engine_config, revision)
        self.cache = CachedSequenceInterface.from_model(self.model, model_config, engine_config, self.device)
        if self.cache.kv_groups() != self.namespace.groups:
            raise RuntimeError(f"the model caches {self.cache.kv_groups()}, its namespace names {self.namespace.groups}")
        self.kv_cache_manager = self.cache.manager
        self.runner = ModelRunner(self.model, self.cache, engine_config.kv_kernel)
        self.connector_scheduler, self.connector_worker = _split_connector(connector)
        if connector is not None:
            self._check_connector(connector)
        self.scheduler = Scheduler(engine_config, self.kv_cache_manager, self.connector_scheduler,
                                   groups=self.namespace.groups,
                                   align=self.cache.has_state and connector is not None)
        self.load_timeouts = LoadTimeouts(self.scheduler, self.kv_cache_manager, self.connector_scheduler)
        self.sampler = Sampler()
        self._seed = seed
        self._counter = itertools.count()
        self._requests: dict[str, Sequence] = {}
        self._held: dict[str, Sequence] = {}  # finished, blocks kept until the connector saved them
        self._load_errors: set[int] = set()
        self._last_step_idle = False
        if self.connector_worker is not None:
            self.connector_worker.register_kv_caches(self.cache.connector_caches())
        n_params = sum(p.numel() for p in self.model.parameters())
        logger.info("engine ready: %.1fM parameters (%s) on %s, namespace revision %s",
                    n_params / 1e6, model_config.dtype, self.device, revision)

    def _check_connector(self, connector: object) -> None:
        """Refuse (one line) a connector that could not store or restore this model's cache."""
        self.cache.check_storable()
        if self.cache.has_state and self.engine_config.max_num_batched_tokens < self.engine_config.block_size:
            raise ConfigError(f"engine.max_num_batched_tokens ({self.engine_config.max_num_batched_tokens}) must "
                              f"hold a block ({self.engine_config.block_size}) to store recurrent state: prefill "
                              f"chunks end on block boundaries")
        mine = self.namespace
        for ns in _namespaces_of(connector):
            if getattr(ns, "groups", ()) != mine.groups:
                have = [g.kind for g in ns.groups] or "none"
                raise ConfigError(f"the connector's namespace has KV groups {have}, this {self.model_config.kind} "
                                  f"model needs {[g.kind for g in mine.groups] or 'none'} "
                                  f"(build it with engine_namespace())")
            if isinstance(ns, Namespace) and ns != mine:  # its blocks hold another model's (or layout's) KV
                differ = [f.name for f in fields(Namespace) if getattr(ns, f.name) != getattr(mine, f.name)]
                raise ConfigError(f"the connector's namespace differs from this engine's in {', '.join(differ)}: "
                                  f"its stored blocks are not this engine's KV (build it with engine_namespace())")

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Seq[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        return self._admit(self._checked_request(prompt_token_ids, sampling_params, request_id))

    def _checked_request(self, prompt_token_ids: Seq[int], sampling_params: SamplingParams | None,
                         request_id: str | None) -> Sequence:
        """A new request, checked (a ConfigError otherwise); not queued yet."""
        params = sampling_params or SamplingParams()
        prompt = [int(t) for t in prompt_token_ids]
        index = next(self._counter)
        request_id = request_id if request_id is not None else f"req-{index}"
        if request_id in self._requests or request_id in self._held or self.load_timeouts.holds(request_id):
            raise ConfigError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise ConfigError("prompt_token_ids must not be empty")
        vocab = self.model_config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ConfigError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ConfigError(f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds "
                              f"max_model_len {self.max_model_len}")
        seed = params.seed if params.seed is not None else (self._seed * 1_000_003 + index) % 2**63
        request = Sequence(request_id, prompt, params, KeyChain(self.namespace), seed)
        if self.kv_cache_manager.blocks_to_completion(request) > self.kv_cache_manager.get_max_resource_count():
            raise ConfigError(f"request {request_id!r} needs more KV blocks than the pool has "
                              f"({self.engine_config.num_blocks})")
        return request

    def _admit(self, request: Sequence) -> str:
        self._requests[request.request_id] = request
        self.sampler.add_request(request.request_id, request.seed)
        self.scheduler.add_request(request)
        return request.request_id

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_held_requests(self) -> int:
        """Finished requests whose blocks the connector still holds."""
        return len(self._held)

    def generate(self, prompts: Seq[Seq[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[Output]:
        """Run the prompts to completion; outputs in prompt order."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ConfigError("need one SamplingParams per prompt")
        # every prompt checked before any is queued: a bad one leaves nothing behind to run later
        requests = [self._checked_request(p, sp, None) for p, sp in zip(prompts, params_list, strict=True)]
        ids = [self._admit(r) for r in requests]
        done: dict[str, Output] = {}
        while self.has_unfinished_requests():
            for output in self.step():
                done[output.request_id] = output
            if self._last_step_idle:
                time.sleep(0.0005)
        self.drain(self.engine_config.drain_timeout_s)
        return [done[i] for i in ids]

    def drain(self, timeout_s: float) -> bool:
        """Step until the connector released every held block (or ``timeout_s`` passed).

        Only for an engine without unfinished requests (their outputs would be lost here).
        """
        if self.has_unfinished_requests():
            raise RuntimeError("drain() needs an engine without unfinished requests; step() them first")
        deadline = time.monotonic() + timeout_s
        while self._held and time.monotonic() < deadline:
            self.step()
            if self._held:
                time.sleep(0.0005)
        if self._held:
            logger.warning("%d finished requests still hold KV blocks after %.1fs", len(self._held), timeout_s)
        return not self._held

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[Output]:
        """One engine iteration; returns the requests that finished in it."""
        batch = self.scheduler.schedule()
        scheduler_output = self.scheduler.build_scheduler_output(batch)
        worker = self.connector_worker
        if self.connector_scheduler is not None:
            meta = self.connector_scheduler.build_connector_meta(scheduler_output)
            worker.bind_connector_meta(meta)
            worker.start_load_kv()
        result = self.runner.run(batch, hooks=worker) if batch.num_tokens else None
        rolled_back: set[str] = set()
        if worker is not None:
            worker.wait_for_save()
            self._collect_load_errors()
            for request in batch.new_requests:
                if not request.load_async and request.pending_load_blocks and self._validate_load(request):
                    rolled_back.add(request.request_id)
        self._commit(batch, rolled_back)
        if result is not None and result.logits is not None:
            self._sample(result.sampling_requests, result.logits, rolled_back)
        self.kv_cache_manager.update_resources(batch)
        outputs = self._finish([r for r in batch.requests if r.finish_reason is not None])
        if worker is not None:
            self._poll_connector(batch, [o.request_id for o in outputs])
        self._last_step_idle = not batch.num_tokens
        return outputs

    def _commit(self, batch: ScheduledBatch, rolled_back: set[str]) -> None:
        for request in batch.requests:
            n = batch.num_scheduled_tokens[request.request_id]
            start = request.num_computed_tokens
            request.num_prefilled_tokens += max(0, min(start + n, request.num_prompt_tokens) - start)
            if request.request_id not in rolled_back:
                request.num_computed_tokens = start + n

    def _sample(self, requests: list[Sequence], logits: torch.Tensor, rolled_back: set[str]) -> None:
        keep = [i for i, r in enumerate(requests) if r.request_id not in rolled_back]
        if not keep:
            return
        requests = [requests[i] for i in keep]
        logits = logits[keep] if len(keep) != logits.shape[0] else logits
        tokens = self.sampler.sample(logits, [r.request_id for r in requests],
                                     [r.sampling_params for r in requests])
        for row, (request, token) in enumerate(zip(requests, tokens, strict=True)):
            if request.logits is not None:
                request.logits.append(logits[row].float().cpu())
            request.append_token(token)

    def _finish(self, finished: list[Sequence]) -> list[Output]:
        outputs = []
        for request in finished:
            request.finish_time = time.perf_counter()
            self.scheduler.finish(request)
            self.sampler.remove_request(request.request_id)
            del self._requests[request.request_id]
            hold = False
            if self.connector_scheduler is not None:
                hold = bool(self.connector_scheduler.request_finished(self.scheduler.view(request),
                                                                      self.scheduler.block_ids(request)))
            if hold:
                self._held[request.request_id] = request
            else:
                self.kv_cache_manager.free_resources(request)
            outputs.append(self._output(request))
        return outputs

    def _poll_connector(self, batch: ScheduledBatch, finished_ids: list[str]) -> None:
        started = [r.request_id for r in batch.loading_requests]
        saved, loaded = self.connector_worker.get_finished(finished_ids, started)
        for request_id in saved or ():
            request = self._held.pop(request_id, None)
            if request is not None:
                self.kv_cache_manager.free_resources(request)
        if loaded:
            self._collect_load_errors()
            for request_id in loaded:
                request = self.scheduler.loading.get(request_id)
                if request is None:
                    continue
                request.num_computed_tokens = request.num_cached_tokens + request.num_external_tokens
                self._validate_load(request)
                self.scheduler.loaded(request)
            self.load_timeouts.reported(loaded)  # (after their errors were taken: the ids are ours)
        self.load_timeouts.give_up_overdue()
        pending = {b for r in self.scheduler.loading.values() for b in r.pending_load_blocks}
        self._load_errors &= pending

    # ---- load failures -------------------------------------------------------------------------
    def _collect_load_errors(self) -> None:
        failed = self.connector_worker.get_block_ids_with_load_errors()
        if failed:
            self._load_errors |= set(failed)

    def _validate_load(self, request: Sequence) -> bool:
        """Roll the request back to its first failed loaded block; True when it was rolled back."""
        pending, request.pending_load_blocks = request.pending_load_blocks, []
        bad = [i for i, block_id in enumerate(pending) if block_id in self._load_errors]
        self._load_errors.difference_update(pending)
        if not bad:
            request.state_loaded = self.cache.has_state and bool(pending)
            return False
        first_block = request.num_cached_tokens // self.engine_config.block_size + bad[0]
        position = first_block * self.engine_config.block_size
        if self.cache.has_state:  # the state exists at the loaded prefix's end only: start over
            position = request.num_cached_tokens
            self.kv_cache_manager.reset_state(request)
        logger.warning("%s: %d of %d loaded blocks failed; recomputing from token %d", request.request_id,
                       len(bad), len(pending), position)
        request.num_external_tokens = position - request.num_cached_tokens
        request.num_computed_tokens = position
        return True

    def _output(self, request: Sequence) -> Output:
        first = request.first_token_time if request.first_token_time is not None else request.finish_time
        return Output(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=request.output_token_ids,
            finish_reason=request.finish_reason or "length",
            ttft_s=first - request.arrival_time,
            e2e_s=request.finish_time - request.arrival_time,
            num_cached_tokens=request.num_cached_tokens,
            num_external_tokens=request.num_external_tokens,
            num_prefilled_tokens=request.num_prefilled_tokens,
            logits=request.logits,
            state_loaded=request.state_loaded,
        )

    def get_request(self, request_id: str) -> Sequence | None:
        return self._requests.get(request_id) or self._held.get(request_id)

    @property
    def status_counts(self) -> dict[str, int]:
        counts = {s.value: 0 for s in RequestStatus}
        for request in self._requests.values():
            counts[request.status.value] += 1
        return counts
