"""``ScheduledBatch``: one step's work, as the scheduler hands it to the KV cache manager and the runner.

It lists the requests computed this step with their token counts, and the requests admitted this
step with their device prefix hits. The scheduler builds it; :class:`~.kv_cache_manager.KVCacheManager`
allocates blocks from it and :class:`~.model_runner.ModelRunner` runs it, so neither depends on the
scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiered_kv.engine.sequence import RequestStatus, Sequence


@dataclass
class ScheduledBatch:
    """One step's work."""

    requests: list[Sequence] = field(default_factory=list)  # computed this step: decodes, then prefills
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # tokens per computed request
    new_requests: list[Sequence] = field(default_factory=list)  # admitted this step (incl. async loads)
    cached_blocks: dict[str, list[int]] = field(default_factory=dict)  # device prefix hits of new ones

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def loading_requests(self) -> list[Sequence]:
        return [r for r in self.new_requests if r.status is RequestStatus.WAITING_FOR_REMOTE_KVS]

    def add(self, request: Sequence, num_tokens: int) -> None:
        self.requests.append(request)
        self.num_scheduled_tokens[request.request_id] = num_tokens
