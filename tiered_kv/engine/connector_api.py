"""What the reference engine hands an optional KV connector, and the calls it makes.

The engine drives a connector in TensorRT-LLM's executor order, once per step::

    schedule
      for each newly scheduled request:
        get_num_new_matched_tokens -> allocate blocks -> update_state_after_alloc
    build_connector_meta(scheduler_output)            (every step, even an empty one)
    bind_connector_meta(meta) ; start_load_kv()
    forward: per layer  wait_for_layer_load(i) -> attention writes KV -> save_kv_layer(i)
    wait_for_save()
    get_block_ids_with_load_errors()                  (sync loads of this step are checked)
    sample
    request_finished(request, block_ids)              (for each request finished this step)
    get_finished(finished_req_ids, started_loading_req_ids)
    get_block_ids_with_load_errors()                  (again, when async loads were reported)

An async load not reported within ``EngineConfig.load_timeout_s`` is given up: its request
computes those tokens on fresh blocks (a hybrid: a fresh state slot too), announced by a second
``update_state_after_alloc`` with 0 external tokens; the blocks (and slot) the load was given stay
unused until ``get_finished`` reports the request id as loaded (a late load may still write them).

A request whose loaded blocks failed is recomputed from its first failed block (a sync-loaded
request also drops the token sampled in that step). Error ids may be reported once or repeatedly:
the engine only applies them to blocks it has not yet validated.

``register_kv_caches`` is called once at start-up with the whole KV buffer
``[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 = K, 1 = V); block
``b`` of layer ``l`` is ``kv[:, l, b]``. One object may implement both halves (:class:`KVConnector`),
or the engine is given a ``(scheduler_half, worker_half)`` pair.

Models with KV cache groups (the namespace's ``groups``: MLA, the Mamba2 + attention hybrid) get
one entry per group instead, in group order: ``register_kv_caches`` a list of buffers (an ``mla``
group: ``[L, num_blocks, block_size, latent_dim]``; a ``full`` group: the K/V buffer above over
the attention layers; a ``state`` group: ``[L, slots, state_elems]``, a layer's conv state then
its SSM state per slot), and every block-id argument or field (``update_state_after_alloc``'s and
``request_finished``'s ``block_ids``, ``RequestData.new_block_ids``, ``RequestView.block_ids``) a
tuple of one list per group: a token group's blocks, a state group's ``[slot]`` (``[]`` in a cached
request's delta, where nothing new is allocated). Such a model with state prefills in chunks that
end on block boundaries (see :mod:`.scheduler`); a failed load of it is recomputed from its first
token (the state exists only at the end of the loaded prefix). The per-layer hooks run around
the layers that page KV (a hybrid's attention layers, numbered among themselves); the recurrent
layers read their slot after ``start_load_kv``, which must have written a sync load's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class RequestView:
    """A read-only snapshot of one request, as the connector sees it."""

    request_id: str  # engine-wide unique id
    prompt_token_ids: tuple[int, ...]  # the prompt
    all_token_ids: tuple[int, ...]  # prompt + generated tokens so far
    num_prompt_tokens: int  # len(prompt_token_ids)
    block_ids: tuple  # device blocks of the request, in token order (with KV groups: one list per group)
    num_computed_tokens: int = 0  # tokens with KV on device; in update_state_after_alloc: the
    #                               device prefix hit, the external tokens to load excluded


@dataclass(frozen=True)
class RequestData:
    """One request's part of a step (TensorRT-LLM's ``RequestData``)."""

    request_id: str  # the request
    new_tokens: tuple[int, ...]  # tokens not reported before (the whole prompt for a new request)
    new_block_ids: tuple  # device blocks not reported before (with KV groups: one list per group)
    computed_position: int  # tokens whose KV was on device before this step (new: device prefix
    #                         hit only, connector-matched tokens excluded)
    num_scheduled_tokens: int  # tokens the engine computes in this step (0 while loading)


@dataclass(frozen=True)
class SchedulerOutput:
    """What the engine scheduled in one step."""

    new_requests: tuple[RequestData, ...] = ()  # requests scheduled for the first time (each once)
    cached_requests: tuple[RequestData, ...] = ()  # requests scheduled before, with their deltas
    finished_req_ids: tuple[str, ...] = field(default=())  # requests finished since the last step


@runtime_checkable
class ConnectorScheduler(Protocol):
    """Scheduler half: decides what is loaded and saved; never touches tensors."""

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens available externally beyond ``num_computed_tokens`` (the device prefix hit), and
        whether they arrive asynchronously. Side-effect free; may be called again for the same
        request."""
        ...

    def update_state_after_alloc(self, request: RequestView, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """The request got ``block_ids`` (all its prompt blocks); ``num_external_tokens`` tokens
        after the device prefix hit are to be loaded (0 = nothing to load). Called again with 0
        and the request's new blocks when its async load was given up (``load_timeout_s``)."""
        ...

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object:
        """Per-step metadata handed to the worker half (every step, even empty ones)."""
        ...

    def request_finished(self, request: RequestView, block_ids: list[int]) -> bool:
        """The request finished. True = the connector still reads ``block_ids`` and the engine
        keeps them until ``get_finished`` reports the request id as saved."""
        ...


@runtime_checkable
class ConnectorWorker(Protocol):
    """Worker half: moves KV bytes between the device buffer and the store."""

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        """The whole ``[2, L, num_blocks, block_size, H, D]`` KV buffer, once at start-up."""
        ...

    def bind_connector_meta(self, meta: object) -> None:
        ...

    def start_load_kv(self) -> None:
        """Start (sync: finish) the loads of this step's metadata, before the forward."""
        ...

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Called before layer ``layer_idx`` reads its KV."""
        ...

    def save_kv_layer(self, layer_idx: int) -> None:
        """Called after layer ``layer_idx`` wrote this step's KV."""
        ...

    def wait_for_save(self) -> None:
        """Called after the forward; saves that must not outlive the step finish here."""
        ...

    def get_finished(self, finished_req_ids: list[str],
                     started_loading_req_ids: list[str]) -> tuple[list[str], list[str]]:
        """(saved ids, loaded ids). An id is returned only after it was passed in (saved: in
        ``finished_req_ids``; loaded: in ``started_loading_req_ids``), in this or an earlier step."""
        ...

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device block ids whose load failed; the engine recomputes from the first of them."""
        ...


@runtime_checkable
class KVConnector(ConnectorScheduler, ConnectorWorker, Protocol):
    """Both halves in one object."""
