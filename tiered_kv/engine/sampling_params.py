"""How one request picks its next tokens and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tiered_kv.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings; temperature 0 is greedy."""

    max_tokens: int = 16  # tokens to generate (fewer if a stop token comes first)
    temperature: float = 0.0  # 0 = greedy (argmax); > 0 = sample from softmax(logits / T)
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p; 1 = all
    seed: int | None = None  # per-request generator seed; None = derived from the engine seed
    stop_token_ids: tuple[int, ...] = ()  # generation ends after one of these (it is kept)
    return_logits: bool = False  # keep the fp32 logits row of every generated token in Output

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ConfigError(f"sampling.max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < math.inf:
            raise ConfigError(f"sampling.temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"sampling.top_k must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ConfigError(f"sampling.top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"sampling.seed must be an integer or None, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
