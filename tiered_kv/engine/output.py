"""What the engine returns for a finished request."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Output:
    """A finished request."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated tokens (a stop token included)
    finish_reason: str  # "length" or "stop"
    ttft_s: float  # request entered the engine -> first generated token
    e2e_s: float  # request entered the engine -> finished
    num_cached_tokens: int  # prompt tokens reused from device blocks
    num_external_tokens: int  # prompt tokens loaded by the connector (after any failed blocks)
    num_prefilled_tokens: int  # prompt tokens computed (recomputation included)
    logits: list[torch.Tensor] | None = None  # fp32 logits of each generated token (return_logits)
    state_loaded: bool = False  # recurrent state resumed from a connector-loaded state entry (hybrid)
