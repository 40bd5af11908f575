"""Runs one scheduled step of the model over the paged KV buffer.

Turns the batch into flat device tensors (token ids, positions, slot mapping, block tables), runs
the forward with the connector's per-layer hooks, and returns the logits of the requests whose
every token is now computed (those sample a token this step).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tiered_kv.engine.attention import Attention, AttentionMetadata
from tiered_kv.engine.batch import ScheduledBatch
from tiered_kv.engine.cached_sequence import CachedSequenceInterface
from tiered_kv.engine.kv_kernel import select_store_kvcache
from tiered_kv.engine.model import LlamaForCausalLM
from tiered_kv.engine.sequence import Sequence

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class StepResult:
    """Logits rows (``[B, vocab]``) of the requests that sample this step, in that order."""

    sampling_requests: list[Sequence]
    logits: torch.Tensor | None


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: CachedSequenceInterface, kv_kernel: str) -> None:
        self.model = model
        self.kv = cache.manager
        self.device = model.device
        self.block_size = self.kv.block_size
        cache.bind()  # every layer's views into the managers' buffers (or its own)
        store_fn = select_store_kvcache(kv_kernel, self.device)
        logger.info("store_kvcache: %s", store_fn.__name__)
        for module in model.modules():
            if isinstance(module, Attention):
                module.store_kvcache = store_fn

    def prepare(self, batch: ScheduledBatch, hooks: object | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[Sequence]]:
        token_ids: list[int] = []
        positions, slots, tables = [], [], []
        starts, context_lens = [0], []
        last_rows, sampling = [], []
        for request in batch.requests:
            n = batch.num_scheduled_tokens[request.request_id]
            first = request.num_computed_tokens
            token_ids.extend(request.token_ids[first:first + n])
            pos = torch.arange(first, first + n)
            table = torch.tensor(request.block_ids, dtype=torch.long)
            positions.append(pos)
            slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            tables.append(table.to(self.device, non_blocking=True))
            starts.append(starts[-1] + n)
            context_lens.append(first + n)
            if first + n == request.num_tokens:
                last_rows.append(starts[-1] - 1)
                sampling.append(request)
        device = self.device
        input_ids = torch.tensor(token_ids, dtype=torch.long).to(device, non_blocking=True)
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(device, non_blocking=True),
            query_starts=starts,
            context_lens=context_lens,
            block_tables=tables,
            hooks=hooks,
            state_slots=[self.kv.state_slot(r.request_id) for r in batch.requests] if self.kv.has_state else [],
            decoding=[r.num_computed_tokens >= r.num_prompt_tokens for r in batch.requests],
        )
        return input_ids, torch.cat(positions).to(device, non_blocking=True), meta, last_rows, sampling

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, hooks: object | None = None) -> StepResult:
        """Forward the batch (which must schedule at least one token)."""
        input_ids, positions, meta, last_rows, sampling = self.prepare(batch, hooks)
        hidden = self.model(input_ids, positions, meta)
        if not last_rows:
            return StepResult(sampling, None)
        rows = torch.tensor(last_rows, dtype=torch.long, device=self.device)
        return StepResult(sampling, self.model.compute_logits(hidden[rows]))
