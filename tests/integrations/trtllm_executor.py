"""A stand-in for TensorRT-LLM's PyExecutor that drives a connector in the executor's exact order.

What it copies from TensorRT-LLM (``pyexecutor/kv_cache_connector.py``, ``resource_manager.py``):

- ``add_sequence`` allocates every prompt block, asks ``get_num_new_matched_tokens(request,
  device_prefix)``, sets ``context_current_position = device_prefix + matched`` and calls
  ``update_state_after_alloc(request, block_ids)``; an async match moves the request out of the
  scheduled batch until ``get_finished`` reports it loaded;
- the ``SchedulerOutput`` built like ``KvCacheConnectorSchedulerOutputManager``: a request is
  "new" the first time it is in a batch (``new_tokens`` = all its tokens, ``computed_position``
  minus the tokens matched in this step), "cached" after (deltas; a generation request has
  ``computed_position = len(tokens) - 1`` and one scheduled token);
- per step: ``build_connector_meta`` -> ``bind_connector_meta`` -> ``start_load_kv`` -> per layer
  ``wait_for_layer_load`` / ``save_kv_layer`` -> ``wait_for_save`` -> sample ->
  ``request_finished`` -> ``get_finished(new saving ids, new loading ids)``;
- a cancel (``_handle_canceled_requests`` then ``_handle_responses`` -> ``_terminate_request``: after
  the step's sampling, before ``get_finished``; ``request_finished`` for any request the KV cache
  manager holds, an async load in flight included, its blocks freed unless held) and a pause
  (``_pause_requests``, MAX_UTILIZATION: ``LlmRequest.pause`` folds the generated tokens into the
  prompt and restarts its context, then ``_terminate_request``). The output manager keeps its
  entry (``KvCacheConnectorSchedulerOutputManager.requests`` is never emptied before
  ``reset_request``): scheduled again, the request is *cached*, with deltas against its old blocks;
- ``v2=True`` (``KVCacheManagerV2``): ``register_kv_cache_layout(KvCacheLayout)`` in place of
  ``register_kv_caches``, and the per-layer-group forms ``update_state_after_alloc_by_layer_group``
  / ``request_finished_by_layer_group`` with one group's list, ``new_block_ids_by_layer_group``
  beside ``new_block_ids`` in the scheduler output.

The "model" writes a KV value per (position, layer, K/V, head, dim) that depends on every token up
to that position, head-major within a block as TensorRT-LLM's attention does (``[K/V, heads, tokens,
dim]``: its ``KVBlockArray``, ``kv_layout`` HND), and samples a token from the KV of the whole sequence read back from the pool:
a wrong or missing loaded block changes the output.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field

import torch

LAYERS, HEADS, DIM, BS = 2, 2, 4, 4
VOCAB = 1000


@dataclass
class LlmArgs:
    """The fields of ``TorchLlmArgs`` the adapter reads."""

    model: str
    kv_cache_config: object
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    dtype: str = "float32"
    max_seq_len: int | None = None
    quant_config: object | None = None  # TensorRT-LLM's QuantConfig (QuantConfig() unless set)
    load_format: object = "auto"
    model_kwargs: dict | None = None
    force_dynamic_quantization: bool = False


@dataclass
class QuantConfig:
    """TensorRT-LLM's ``QuantConfig`` dataclass: its declared fields and defaults, and one of its
    cached properties (a value that lands in ``__dict__`` once read)."""

    quant_algo: str | None = None
    kv_cache_quant_algo: str | None = None
    group_size: int = 128
    smoothquant_val: float = 0.5
    clamp_val: list[float] | None = None
    use_meta_recipe: bool = False
    has_zero_point: bool = False
    pre_quant_scale: bool = False
    exclude_modules: list[str] | None = None

    @functools.cached_property
    def quant_mode(self) -> object:
        return object()  # (an object whose str() differs per instance)


@dataclass
class KvCacheConfig:
    tokens_per_block: int = BS
    dtype: str = "auto"
    max_attention_window: list[int] | None = None  # one window per layer (repeated over layers)


@dataclass
class RequestData:
    request_id: int
    new_tokens: list[int]
    new_block_ids: list[int]
    computed_position: int
    num_scheduled_tokens: int
    new_block_ids_by_layer_group: list[list[int]] | None = None  # KVCacheManagerV2


@dataclass
class LayerGroupLayout:
    """The fields of ``KvCacheLayerGroupLayout`` the adapter reads."""

    layer_group_id: int
    window_size: int | None
    layer_ids: tuple[int, ...]


class KvCacheLayout:
    """The parts of ``KvCacheLayout`` (``KVCacheManagerV2``) the adapter reads: its layer groups
    and the single-pool view (None when the pages are not one pool)."""

    def __init__(self, pool, groups: list[LayerGroupLayout] | None = None, single_pool: bool = True) -> None:
        self.pool = pool
        self.groups = groups or [LayerGroupLayout(0, None, tuple(range(LAYERS)))]
        self.single_pool = single_pool

    def as_single_pool_tensor(self):
        return self.pool if self.single_pool and len(self.groups) == 1 else None


@dataclass
class SchedulerOutput:
    new_requests: list[RequestData] = field(default_factory=list)
    cached_requests: list[RequestData] = field(default_factory=list)


@dataclass
class LlmRequest:
    """The fields of ``LlmRequest`` the adapter and this executor use."""

    request_id: int
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    context_current_position: int = 0
    state: str = "new"  # new | context | loading | generation | saving | done
    block_ids: list[int] = field(default_factory=list)
    matched: int = 0

    def get_tokens(self, beam: int) -> list[int]:
        return list(self.tokens)

    @property
    def is_finished(self) -> bool:
        """``LlmRequest.is_finished``: GENERATION_COMPLETE (finished, cancelled, failed); a paused
        request is back in CONTEXT_INIT, not finished."""
        return self.state == "done"


def write_model_config(path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    config = {"num_hidden_layers": LAYERS, "num_attention_heads": HEADS * 2, "num_key_value_heads": HEADS,
              "head_dim": DIM, "hidden_size": HEADS * 2 * DIM, "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config))


def kv_of(tokens: list[int], pos: int) -> torch.Tensor:
    """``[LAYERS, 2, HEADS, DIM]`` KV of position ``pos``: depends on tokens[:pos + 1]."""
    state = 7
    for t in tokens[: pos + 1]:
        state = (state * 31 + t) % 1_000_003
    base = torch.arange(LAYERS * 2 * HEADS * DIM, dtype=torch.float32).view(LAYERS, 2, HEADS, DIM)
    return base * 0.01 + float(state % 9973)


class Executor:
    """Continuous batching with chunked prefill over a pool ``[blocks, layers, 2, bs*heads*dim]``."""

    def __init__(self, scheduler, worker, *, num_blocks: int = 64, max_tokens_per_step: int = 64,
                 v2: bool = False) -> None:
        self.scheduler, self.worker = scheduler, worker
        self.v2 = v2  # KVCacheManagerV2: a layout at registration, block ids per layer group
        self.pool = torch.zeros(num_blocks, LAYERS, 2, BS * HEADS * DIM)
        self.free = list(range(num_blocks))
        self.budget = max_tokens_per_step
        self.requests: dict[int, LlmRequest] = {}
        self.reported: dict[int, tuple[int, int]] = {}  # request -> (tokens, blocks) reported
        self.new_loading: set[int] = set()  # async loads not yet passed to get_finished
        self.new_saving: set[int] = set()  # held saves not yet passed to get_finished
        self.held: dict[int, list[int]] = {}  # ended requests -> the blocks the connector holds
        self.to_cancel: set[int] = set()  # cancels to handle in the next step (TensorRT-LLM's queue)
        self.log: list[tuple] = []  # (step, event, request id, detail)
        self.step_no = 0
        self.computed_tokens = 0
        if v2:
            worker.register_kv_cache_layout(KvCacheLayout(self.pool))
        else:
            worker.register_kv_caches(self.pool)

    # -- requests --------------------------------------------------------------------------------
    def add(self, request_id: int, prompt: list[int], max_new_tokens: int = 3) -> LlmRequest:
        req = LlmRequest(request_id, list(prompt), len(prompt), max_new_tokens)
        self.requests[request_id] = req
        return req

    def _add_sequence(self, req: LlmRequest) -> None:
        n_blocks = -(-req.prompt_len // BS)
        req.block_ids = [self.free.pop(0) for _ in range(n_blocks)]
        matched, is_async = self.scheduler.get_num_new_matched_tokens(req, 0)
        assert not (matched == 0 and is_async), "load_kv_async must be False when num_tokens is 0"
        req.matched = matched
        req.context_current_position = matched
        self.log.append((self.step_no, "matched", req.request_id, (matched, is_async)))
        req.state = "loading" if is_async else "context"
        if is_async:
            self.new_loading.add(req.request_id)
        if self.v2:
            self.scheduler.update_state_after_alloc_by_layer_group(req, [list(req.block_ids)])
        else:
            self.scheduler.update_state_after_alloc(req, list(req.block_ids))

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> None:
        self.step_no += 1
        external_loads: dict[int, int] = {}
        for req in self.requests.values():  # prepare_resources: admit new requests
            if req.state == "new" and len(self.free) >= -(-req.prompt_len // BS):
                self._add_sequence(req)
                if req.state == "context":
                    external_loads[req.request_id] = req.matched
        budget, batch = self.budget, []
        for req in self.requests.values():
            if req.state == "context" and budget > 0:
                chunk = min(budget, req.prompt_len - req.context_current_position)
                batch.append((req, chunk))
                budget -= chunk
            elif req.state == "generation":
                if len(req.tokens) > len(req.block_ids) * BS:
                    req.block_ids.append(self.free.pop(0))
                batch.append((req, 1))
        out = SchedulerOutput()
        for req, chunk in batch:
            tokens, blocks = self.reported.get(req.request_id, (0, 0))
            is_new = req.request_id not in self.reported
            if req.state == "context":
                position = req.context_current_position - external_loads.get(req.request_id, 0)
            else:
                position = len(req.tokens) - 1
            data = RequestData(req.request_id, req.tokens[tokens:], req.block_ids[blocks:], position, chunk,
                               [req.block_ids[blocks:]] if self.v2 else None)
            self.reported[req.request_id] = (len(req.tokens), len(req.block_ids))
            (out.new_requests if is_new else out.cached_requests).append(data)
        self.worker.bind_connector_meta(self.scheduler.build_connector_meta(out))
        self.worker.start_load_kv(None)
        self._forward(batch)
        self.worker.wait_for_save(None)
        finished = self._sample(batch)
        for rid in sorted(self.to_cancel):  # (_handle_canceled_requests: finished by reason CANCELLED)
            req = self.requests[rid]
            if req.state == "new":  # not in the KV cache manager (get_cache_indices raises): no call
                req.state = "done"
            elif req.state not in ("done", "saving", "stalled"):
                req.state = "done"
                finished.append(req)
        self.to_cancel.clear()
        for req in finished:
            if self.v2:
                hold = self.scheduler.request_finished_by_layer_group(req, [list(req.block_ids)])
            else:
                hold = self.scheduler.request_finished(req, list(req.block_ids))
            self.log.append((self.step_no, "finished", req.request_id, hold))
            self._end(req, hold)
        self._get_finished()

    def cancel(self, rid: int) -> None:
        """A client's cancel, handled in the next step after its sampling (see :meth:`step`)."""
        self.to_cancel.add(rid)

    def pause(self, rid: int) -> None:
        """``_pause_requests`` before the step's allocation (releases whose ``_pause_requests`` is
        ``req.pause(max_input_len); self._terminate_request(req)``): ``LlmRequest.pause`` first (the
        generated tokens become prompt, the context restarts at 0, CONTEXT_INIT: not finished),
        then ``_do_terminate_request``: ``request_finished``, then ``free_resources`` (blocks a True
        pinned by ``store_blocks_for_reuse`` until ``get_finished``). Its entry in ``reported``
        stays (the output manager's). A request the connector holds is set to
        ``DISAGG_CONTEXT_TRANS_IN_PROGRESS`` by ``KvCacheConnectorManager.request_finished``;
        ``_kv_connector_terminate_requests`` only unpins its blocks once saved and no scheduler
        picks that state up again: parked here as "stalled" for good."""
        req = self.requests[rid]
        req.max_new_tokens -= len(req.tokens) - req.prompt_len
        req.prompt_len, req.context_current_position, req.matched, req.state = len(req.tokens), 0, 0, "new"
        hold = self.scheduler.request_finished(req, list(req.block_ids))
        self.log.append((self.step_no, "paused", rid, hold))
        self._end(req, hold)
        if hold:
            req.state = "stalled"

    def _end(self, req, hold: bool) -> None:
        """An ended request: its blocks held while the connector saves it, else freed."""
        if hold:
            req.state = "saving"
            self.held[req.request_id] = req.block_ids
            self.new_saving.add(req.request_id)
        else:
            self._free(req)

    def _forward(self, batch) -> None:
        for layer in range(LAYERS):
            self.worker.wait_for_layer_load(layer, None)
            for req, chunk in batch:
                start = req.context_current_position if req.state == "context" else len(req.tokens) - 1
                for pos in range(start, start + chunk):
                    block = self.pool[req.block_ids[pos // BS], layer].view(2, HEADS, BS, DIM)  # head-major
                    block[:, :, pos % BS] = kv_of(req.tokens, pos)[layer]
            self.worker.save_kv_layer(layer, None)
        self.computed_tokens += sum(chunk for _, chunk in batch)

    def _sample(self, batch) -> list[LlmRequest]:
        finished = []
        for req, chunk in batch:
            if req.state == "context":
                req.context_current_position += chunk
                if req.context_current_position < req.prompt_len:
                    continue
                req.state = "generation"
            req.tokens.append(self._next_token(req))
            if len(req.tokens) - req.prompt_len >= req.max_new_tokens:
                req.state = "done"
                finished.append(req)
        return finished

    def _next_token(self, req: LlmRequest) -> int:
        """A token from the KV of every position, read back from the pool."""
        acc = 0
        for pos in range(len(req.tokens)):
            kv = self.pool[req.block_ids[pos // BS]].view(LAYERS, 2, HEADS, BS, DIM)[:, :, :, pos % BS]
            acc = (acc * 131 + int(kv.sum().item() * 100)) % 1_000_000_007
        return 1 + acc % (VOCAB - 1)

    def _get_finished(self) -> None:
        saving, loading = sorted(self.new_saving), sorted(self.new_loading)
        self.new_saving, self.new_loading = set(), set()
        saved, loaded = self.worker.get_finished(saving, loading)
        for rid in saved:
            self.log.append((self.step_no, "saved", rid, None))
            self.free.extend(self.held.pop(rid))
            if self.requests[rid].state == "saving":
                self.requests[rid].state, self.requests[rid].block_ids = "done", []
        for rid in loaded:  # (TensorRT-LLM sets a cancelled one's state too: it is out of the batch)
            self.log.append((self.step_no, "loaded", rid, None))
            if self.requests[rid].state == "loading":
                self.requests[rid].state = "context"

    def _free(self, req: LlmRequest) -> None:
        self.free.extend(req.block_ids)
        req.block_ids = []

    # -- driving ---------------------------------------------------------------------------------
    def run(self, max_steps: int = 500) -> dict[int, list[int]]:
        while any(r.state not in ("done",) for r in self.requests.values()) or self.held:
            self.step()
            assert self.step_no < max_steps, "executor made no progress"
        return {rid: r.tokens[r.prompt_len:] for rid, r in self.requests.items()}


def store_llm_args(tmp_path, monkeypatch) -> LlmArgs:
    """LlmArgs of a model directory under ``tmp_path`` whose store is an LMDB there (configured
    the way a TensorRT-LLM deployment does: ``TIERED_KV_*`` variables, others cleared)."""
    for name in [n for n in os.environ if n.startswith("TIERED_KV_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TIERED_KV_DISK_URL", f"lmdb://{tmp_path}/db")
    monkeypatch.setenv("TIERED_KV_HOST_CAPACITY", "256KiB")
    write_model_config(tmp_path / "model")
    return LlmArgs(model=str(tmp_path / "model"), kv_cache_config=KvCacheConfig())
