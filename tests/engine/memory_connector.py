"""A tiny in-memory KV connector for engine tests (not part of the product).

Blocks live in a dict ``key -> [2, num_layers, block_size, H, D]`` tensor that several engines may
share (a "restart" is a new engine over the same dict). Options make loads async (finished after
``load_delay`` polls of ``get_finished``), hold finished requests' blocks until ``save_delay``
polls later, or corrupt the loads of chosen keys and report their blocks as failed (``early_errors``:
an async load's failed blocks are reported when it starts, before it is reported loaded).
``match_extra`` tokens are added to every non-zero match (an unaligned claim the engine must floor).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tiered_kv.engine.connector_api import RequestView, SchedulerOutput
from tiered_kv.keys import Namespace, block_keys


@dataclass
class _Tracked:
    tokens: list[int]
    block_ids: list[int]
    loads: list[tuple[bytes, int]] = field(default_factory=list)  # (key, device block) to load
    external: int = 0  # tokens the engine takes from us


class MemoryConnector:
    def __init__(self, namespace: Namespace, store: dict | None = None, *, load_async: bool = False,
                 load_delay: int = 2, hold: bool = False, save_delay: int = 2, fail_keys=(),
                 silent_corruption: bool = False, save: bool = True, cap: bool = False,
                 early_errors: bool = False, match_extra: int = 0) -> None:
        self.namespace = namespace
        self.block_size = namespace.block_size
        self.store: dict[bytes, torch.Tensor] = {} if store is None else store
        self.load_async, self.load_delay = load_async, load_delay
        self.hold, self.save_delay = hold, save_delay
        self.fail_keys = set(fail_keys)
        self.silent_corruption = silent_corruption
        self.save, self.cap = save, cap
        self.early_errors, self.match_extra = early_errors, match_extra
        self.calls: list[str] = []
        self.scheduler_outputs: list[SchedulerOutput] = []
        self.kv: torch.Tensor | None = None
        self._requests: dict[str, _Tracked] = {}
        self._meta: dict | None = None
        self._loading: dict[str, int] = {}  # async request -> polls left
        self._load_blocks: dict[str, list[tuple[bytes, int]]] = {}  # async request -> what it loads
        self._saving: dict[str, int] = {}  # held request -> polls left
        self._errors: set[int] = set()
        self._failed_requests: set[str] = set()  # loads failed this step: do not save their KV
        self.started_loading_seen: set[str] = set()
        self.finished_seen: set[str] = set()

    # ---- scheduler half ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        self.calls.append("get_num_new_matched_tokens")
        keys = block_keys(self.namespace, request.prompt_token_ids)
        hits = 0
        for key in keys[num_computed_tokens // self.block_size:]:
            if key not in self.store:
                break
            hits += 1
        matched = hits * self.block_size
        if self.cap:
            matched = min(matched, (request.num_prompt_tokens - 1) // self.block_size * self.block_size
                          - num_computed_tokens)
        if matched > 0:
            matched += self.match_extra
        return max(0, matched), self.load_async and matched > 0

    def update_state_after_alloc(self, request: RequestView, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        self.calls.append("update_state_after_alloc")
        tracked = self._requests.setdefault(request.request_id, _Tracked([], []))
        tracked.external = num_external_tokens
        tracked.block_ids = list(block_ids)  # (called again with new ones when a load is given up)
        if num_external_tokens:
            keys = block_keys(self.namespace, request.prompt_token_ids)
            first = request.num_computed_tokens // self.block_size  # after the device prefix hit
            last = first + num_external_tokens // self.block_size
            tracked.loads = [(keys[i], block_ids[i]) for i in range(first, last)]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> dict:
        self.calls.append("build_connector_meta")
        self.scheduler_outputs.append(scheduler_output)
        loads, saves = {}, []
        for data in scheduler_output.new_requests:
            tracked = self._requests.setdefault(data.request_id, _Tracked([], []))
            tracked.tokens = list(data.new_tokens)
            tracked.block_ids = list(data.new_block_ids)
            if tracked.loads:
                loads[data.request_id] = tracked.loads
            if data.num_scheduled_tokens:
                end = data.computed_position + tracked.external + data.num_scheduled_tokens
                saves += self._blocks_to_save(data.request_id, tracked, end)
        for data in scheduler_output.cached_requests:
            tracked = self._requests[data.request_id]
            tracked.tokens += data.new_tokens
            tracked.block_ids += data.new_block_ids
            saves += self._blocks_to_save(data.request_id, tracked,
                                          data.computed_position + data.num_scheduled_tokens)
        for request_id in scheduler_output.finished_req_ids:
            self._requests.pop(request_id, None)
        return {"loads": loads, "saves": saves if self.save else []}

    def _blocks_to_save(self, request_id: str, tracked: _Tracked, end: int) -> list[tuple[str, bytes, int]]:
        full = end // self.block_size
        keys = block_keys(self.namespace, tracked.tokens[: full * self.block_size])
        return [(request_id, keys[i], tracked.block_ids[i]) for i in range(full) if keys[i] not in self.store]

    def request_finished(self, request: RequestView, block_ids: list[int]) -> bool:
        self.calls.append("request_finished")
        if self.hold:
            self._saving[request.request_id] = self.save_delay
        return self.hold

    # ---- worker half ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        self.calls.append("register_kv_caches")
        self.kv = kv_cache

    def bind_connector_meta(self, meta: dict) -> None:
        self.calls.append("bind_connector_meta")
        self._meta = meta

    def start_load_kv(self) -> None:
        self.calls.append("start_load_kv")
        for request_id, blocks in self._meta["loads"].items():
            if self.load_async:
                self._loading[request_id] = self.load_delay
                self._load_blocks[request_id] = blocks
                if self.early_errors:
                    self._errors.update(block_id for key, block_id in blocks if key in self.fail_keys)
            else:
                self._load(request_id, blocks)

    def _load(self, request_id: str, blocks: list[tuple[bytes, int]]) -> None:
        for key, block_id in blocks:
            if key in self.fail_keys:
                self.kv[:, :, block_id] = 1e4 * torch.randn_like(self.kv[:, :, block_id])
                if not self.silent_corruption:
                    if not (self.load_async and self.early_errors):  # (reported when it started)
                        self._errors.add(block_id)
                    self._failed_requests.add(request_id)
            else:
                self.kv[:, :, block_id] = self.store[key]

    def wait_for_layer_load(self, layer_idx: int) -> None:
        self.calls.append(f"wait_for_layer_load:{layer_idx}")

    def save_kv_layer(self, layer_idx: int) -> None:
        self.calls.append(f"save_kv_layer:{layer_idx}")

    def wait_for_save(self) -> None:
        self.calls.append("wait_for_save")
        for request_id, key, block_id in self._meta["saves"]:
            if request_id not in self._failed_requests:
                self.store.setdefault(key, self.kv[:, :, block_id].clone())
        self._failed_requests.clear()

    def get_finished(self, finished_req_ids: list[str], started_loading_req_ids: list[str]):
        self.calls.append("get_finished")
        self.finished_seen.update(finished_req_ids)
        self.started_loading_seen.update(started_loading_req_ids)
        saved, loaded = [], []
        for request_id in list(self._saving):
            if request_id not in self.finished_seen:
                continue
            self._saving[request_id] -= 1
            if self._saving[request_id] <= 0:
                del self._saving[request_id]
                saved.append(request_id)
        for request_id in list(self._loading):
            if request_id not in self.started_loading_seen:
                continue
            self._loading[request_id] -= 1
            if self._loading[request_id] <= 0:
                del self._loading[request_id]
                self._load(request_id, self._load_blocks.pop(request_id))
                loaded.append(request_id)
        return saved, loaded

    def get_block_ids_with_load_errors(self) -> set[int]:
        self.calls.append("get_block_ids_with_load_errors")
        errors, self._errors = self._errors, set()
        return errors
