"""The hybrid pool: paged KV for the attention layers plus one state slot per running sequence.

The state buffer is ``[num_state_layers, num_slots, state_elems]``: row ``l`` is Mamba2 layer
``l``'s state of every slot, and a slot's vector is the layer's **conv state** (``[conv_dim,
K-1]``, row-major) followed by its **SSM state** (``[heads, head_dim, d_state]``, row-major)
(:class:`StateLayout`). The layers get views of their part; a connector gets the whole buffer, so
a slot's state for all layers is ``state[:, slot]``.

A request gets a zeroed slot when it is admitted (a load then writes the state of its prefix into
it) and returns it when its resources are freed; :meth:`HybridCacheManager.reset_state` zeroes it
again when the request is recomputed from its first token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from tiered_kv.dtypes import torch_dtype
from tiered_kv.engine.batch import ScheduledBatch
from tiered_kv.engine.cache_resources import CausalConvHandler, SSMStateHandler
from tiered_kv.engine.config import EngineConfig, ModelConfig
from tiered_kv.engine.kv_cache_manager import KVCacheManager, SetAside
from tiered_kv.engine.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StateLayout:
    """How one layer's state for one sequence is laid out as a vector."""

    ssm: SSMStateHandler  # the SSM state every managed layer has
    conv: CausalConvHandler | None  # the conv state before it (None: conv states are not managed)

    @property
    def conv_elems(self) -> int:
        return self.conv.numel if self.conv is not None else 0

    @property
    def state_elems(self) -> int:
        return self.conv_elems + self.ssm.numel

    def conv_view(self, layer_state: torch.Tensor) -> torch.Tensor:
        """``[slots, conv_dim, K-1]`` view of one layer's ``[slots, state_elems]`` rows."""
        assert self.conv is not None
        return layer_state[:, :self.conv_elems].unflatten(-1, self.conv.shape)

    def ssm_view(self, layer_state: torch.Tensor) -> torch.Tensor:
        """``[slots, heads, head_dim, d_state]`` view of one layer's rows."""
        return layer_state[:, self.conv_elems:].unflatten(-1, self.ssm.shape)


class HybridCacheManager(KVCacheManager):
    """:class:`KVCacheManager` of the attention layers plus the state slots of the recurrent ones."""

    has_state = True

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, device: torch.device, *,
                 state_layout: StateLayout, num_state_layers: int, **paged) -> None:
        if engine_config.enable_prefix_caching:
            logger.info("device prefix reuse is off for a model with recurrent state (its state at a "
                        "block boundary is not kept on the device)")
        super().__init__(model_config, engine_config, device, prefix_caching=False, **paged)
        self.state_layout = state_layout
        self.num_slots = engine_config.max_num_seqs
        shape = (num_state_layers, self.num_slots, state_layout.state_elems)
        self.state = torch.zeros(shape, dtype=torch_dtype(state_layout.ssm.dtype), device=device)
        self.local_states: list[torch.Tensor] = []  # unmanaged [slots, ...] states, zeroed with a slot
        self._free_slots = list(range(self.num_slots))
        self._slot_of: dict[str, int] = {}
        logger.info("state buffer %s %s: %d slots, %.1f KiB per sequence", list(shape), state_layout.ssm.dtype,
                    self.num_slots, self.state[:, 0].numel() * self.state.element_size() / 1024)

    # ---- slots ---------------------------------------------------------------------------------
    def get_num_free_slots(self) -> int:
        return len(self._free_slots)

    def state_slot(self, request_id: str) -> int | None:
        """The request's slot (None before it is admitted)."""
        return self._slot_of.get(request_id)

    def reset_state(self, request: Sequence) -> None:
        """Zero the request's state (it is computed again from its first token)."""
        slot = self._slot_of[request.request_id]
        self.state[:, slot].zero_()
        for local in self.local_states:
            local[slot].zero_()

    def prepare_resources(self, scheduled_batch: ScheduledBatch) -> None:
        for request in scheduled_batch.new_requests:
            if not self._free_slots:
                raise RuntimeError(f"{request.request_id} admitted without a free state slot")
            self._slot_of[request.request_id] = self._free_slots.pop(0)
            self.reset_state(request)
        super().prepare_resources(scheduled_batch)

    def free_resources(self, request: Sequence) -> None:
        slot = self._slot_of.pop(request.request_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        super().free_resources(request)

    def set_aside(self, request: Sequence, block_ids: list[int]) -> SetAside | None:
        """Blocks as :meth:`KVCacheManager.set_aside`, and the state slot (a load writes the
        state at its prefix's end there): the request continues in a zeroed slot."""
        if not self._free_slots:
            return None
        aside = super().set_aside(request, block_ids)
        if aside is None:
            return None
        slot = self._slot_of.get(request.request_id)
        self._slot_of[request.request_id] = self._free_slots.pop(0)
        self.reset_state(request)
        return replace(aside, slot=slot)

    def release_set_aside(self, aside: SetAside) -> None:
        super().release_set_aside(aside)
        if aside.slot is not None:
            self._free_slots.append(aside.slot)

    # ---- views ---------------------------------------------------------------------------------
    def get_state_buffers(self, layer_idx: int) -> dict[str, torch.Tensor]:
        """Recurrent layer ``layer_idx``'s views: ``conv_state`` (when managed) and ``ssm_state``."""
        rows = self.state[layer_idx]
        views = {"ssm_state": self.state_layout.ssm_view(rows)}
        if self.state_layout.conv is not None:
            views["conv_state"] = self.state_layout.conv_view(rows)
        return views
