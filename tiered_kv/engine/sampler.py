"""Next-token choice: greedy, or seeded temperature / top-k / top-p sampling per request.

Each request samples with its own ``torch.Generator`` (on CPU, from fp32 logits), so its tokens
depend only on its seed and logits, not on which other requests share the batch.
"""

from __future__ import annotations

import torch

from tiered_kv.engine.sampling_params import SamplingParams


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def add_request(self, request_id: str, seed: int) -> None:
        self._generators[request_id] = torch.Generator(device="cpu").manual_seed(seed)

    def remove_request(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, request_ids: list[str],
               params: list[SamplingParams]) -> list[int]:
        """One token per row of ``logits`` ``[B, vocab]`` (any device / dtype)."""
        rows = logits.detach().float().cpu()
        greedy = rows.argmax(dim=-1).tolist()
        tokens = []
        for i, (request_id, p) in enumerate(zip(request_ids, params, strict=True)):
            if p.greedy:
                tokens.append(int(greedy[i]))
            else:
                tokens.append(self._draw(rows[i], p, self._generators[request_id]))
        return tokens

    @staticmethod
    def _draw(row: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
        scores = (row - row.max()) / params.temperature  # (the best is 0: a tiny temperature makes
        # the others -inf, never inf - inf = nan, which torch.multinomial refused with an error)
        if 0 < params.top_k < scores.numel():
            kth = torch.topk(scores, params.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if params.top_p < 1.0:
            ordered, order = torch.sort(scores, descending=True)
            probs = torch.softmax(ordered, dim=-1)
            before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly better tokens
            drop = before >= params.top_p  # the best token is always kept
            scores = scores.scatter(0, order, ordered.masked_fill(drop, float("-inf")))
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator).item())
