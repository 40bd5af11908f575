"""The paged KV pool: one buffer, its blocks, and per-request reservations to completion.

The buffer is ``[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = K, 1 = V)
for full attention, ``[num_layers, num_blocks, block_size, latent_dim]`` for MLA latents
(:func:`paged_pool_shape`; ``num_layers`` counts the layers that page, not a hybrid's others).
Admission is preemption-free: a request is admitted only when the pool can hold it to its last
token, so its not-yet-allocated blocks are *reserved* and every later append succeeds. Method names
follow TensorRT-LLM's ``KVCacheManager``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from tiered_kv.dtypes import torch_dtype
from tiered_kv.engine.batch import ScheduledBatch
from tiered_kv.engine.block_manager import BlockManager
from tiered_kv.engine.cache_resources import PagedKVHandler, ResourceHandler
from tiered_kv.engine.config import EngineConfig, ModelConfig
from tiered_kv.engine.sequence import Sequence

logger = logging.getLogger(__name__)


def paged_pool_shape(page: ResourceHandler, num_layers: int, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """The buffer of ``num_layers`` layers paging ``page``: K/V first for full attention."""
    if isinstance(page, PagedKVHandler):
        return (2, num_layers, num_blocks, block_size, *page.shape[1:])
    return (num_layers, num_blocks, block_size, *page.shape)


def paged_layer_view(page: ResourceHandler, pool: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer ``layer``'s blocks: ``[2, num_blocks, block_size, H, D]`` or ``[num_blocks, block_size, D]``."""
    return pool[:, layer] if isinstance(page, PagedKVHandler) else pool[layer]


@dataclass(frozen=True)
class SetAside:
    """What a request gave up while a load may still write it: device blocks, a state slot."""

    block_ids: tuple[int, ...]
    slot: int | None = None


class KVCacheManager:
    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, device: torch.device, *,
                 page: ResourceHandler | None = None, num_layers: int | None = None,
                 prefix_caching: bool | None = None) -> None:
        self.block_size = engine_config.block_size
        self.num_blocks = engine_config.num_blocks
        self.page = page or PagedKVHandler(model_config.dtype, num_kv_heads=model_config.num_kv_heads,
                                           head_dim=model_config.head_dim)
        num_layers = model_config.num_layers if num_layers is None else num_layers
        shape = paged_pool_shape(self.page, num_layers, self.num_blocks, self.block_size)
        self.kv_cache = torch.zeros(shape, dtype=torch_dtype(self.page.dtype), device=device)
        total = self.kv_cache.numel() * self.kv_cache.element_size()
        logger.info("KV buffer %s %s on %s: %d blocks x %d tokens, %.1f KiB per block, %.1f MiB total",
                    list(shape), self.page.dtype, device, self.num_blocks, self.block_size,
                    total / self.num_blocks / 1024, total / 2**20)
        if prefix_caching is None:
            prefix_caching = engine_config.enable_prefix_caching
        self.block_manager = BlockManager(self.num_blocks, self.block_size, prefix_caching)
        self._requests: dict[str, Sequence] = {}  # requests holding blocks
        self._reserved: dict[str, int] = {}  # blocks each request may still allocate

    # ---- sizes ---------------------------------------------------------------------------------
    def get_max_resource_count(self) -> int:
        """Blocks in the pool."""
        return self.num_blocks

    def get_num_free_blocks(self) -> int:
        """Blocks on the free list (some still hold reusable prefix KV)."""
        return self.block_manager.num_free_blocks

    def get_num_available_blocks(self) -> int:
        """Free blocks not promised to admitted requests."""
        return self.block_manager.num_free_blocks - sum(self._reserved.values())

    def blocks_to_completion(self, request: Sequence) -> int:
        return self.block_manager.blocks_for(request.max_total_tokens)

    def get_needed_resource_to_completion(self, request: Sequence) -> int:
        """Blocks the request still needs beyond those it holds."""
        return max(0, self.blocks_to_completion(request) - len(request.block_ids))

    # ---- admission -----------------------------------------------------------------------------
    def get_cached_blocks(self, request: Sequence) -> list[int]:
        """Device blocks reusable for the request's prompt prefix (side-effect free)."""
        return self.block_manager.get_cached_blocks(request)

    def get_num_blocks_to_admit(self, request: Sequence, cached_blocks: list[int]) -> int:
        """Free blocks that admitting the request takes or reserves (its whole lifetime)."""
        return self.block_manager.num_blocks_to_take(cached_blocks, self.blocks_to_completion(request))

    def can_allocate(self, request: Sequence, cached_blocks: list[int]) -> bool:
        return self.get_num_blocks_to_admit(request, cached_blocks) <= self.get_num_available_blocks()

    def prepare_resources(self, scheduled_batch: ScheduledBatch) -> None:
        """Before the forward: blocks for newly admitted prompts, then room for this step's tokens.

        Prefix hits of all new requests are referenced first, so handing out fresh blocks cannot
        evict a hit that another new request of the same step counts on.
        """
        manager = self.block_manager
        for request in scheduled_batch.new_requests:
            manager.acquire_cached(request, scheduled_batch.cached_blocks[request.request_id])
        for request in scheduled_batch.new_requests:
            manager.allocate(request, manager.blocks_for(request.num_prompt_tokens))
            self._requests[request.request_id] = request
            self._reserved[request.request_id] = self.get_needed_resource_to_completion(request)
        for request in scheduled_batch.requests:
            end = request.num_computed_tokens + scheduled_batch.num_scheduled_tokens[request.request_id]
            added = manager.may_append(request, end)
            if added:
                left = self._reserved.get(request.request_id, 0) - added
                if left < 0:
                    raise RuntimeError(f"{request.request_id} outgrew its reservation")
                self._reserved[request.request_id] = left

    def update_resources(self, scheduled_batch: ScheduledBatch) -> None:
        """After the step: publish newly computed full blocks; finished requests lose their reservation."""
        for request in scheduled_batch.requests:
            if request.request_id in self._requests:
                self.block_manager.register_computed_blocks(request)
            if request.is_finished or request.finish_reason is not None:
                self._reserved.pop(request.request_id, None)

    def free_resources(self, request: Sequence) -> None:
        """Return the request's blocks (shared prefix blocks stay with their other users)."""
        if self._requests.pop(request.request_id, None) is None:
            return
        self._reserved.pop(request.request_id, None)
        self.block_manager.free(request)

    # ---- blocks an abandoned load may still write -----------------------------------------------
    def set_aside(self, request: Sequence, block_ids: list[int]) -> SetAside | None:
        """Move the request off ``block_ids`` (a load it gave up on may still write them) onto
        fresh blocks; None when the pool cannot spare them now. The old ones stay out of use until
        :meth:`release_set_aside`."""
        if len(block_ids) > self.get_num_available_blocks():
            return None
        self.block_manager.set_aside(request, block_ids)
        return SetAside(tuple(block_ids))

    def release_set_aside(self, aside: SetAside) -> None:
        self.block_manager.release(aside.block_ids)

    # ---- views ---------------------------------------------------------------------------------
    def get_batch_cache_indices(self, request_ids: Iterable[str]) -> list[list[int]]:
        """Block ids of each request, in token order."""
        return [list(self._requests[rid].block_ids) for rid in request_ids]

    def get_buffers(self, layer_idx: int) -> torch.Tensor:
        """Layer ``layer_idx``'s ``[2, num_blocks, block_size, H, D]`` (MLA: ``[num_blocks,
        block_size, D]``) view of the buffer."""
        return paged_layer_view(self.page, self.kv_cache, layer_idx)

    # ---- state (none here; see HybridCacheManager) ---------------------------------------------
    has_state = False

    def get_num_free_slots(self) -> int | None:
        """State slots free for new requests; None: the pool keeps no per-sequence state."""
        return None
