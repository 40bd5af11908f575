"""One request's tokens, blocks and progress, as the scheduler tracks it (no torch here)."""

from __future__ import annotations

import enum
import time

from tiered_kv.engine.connector_api import RequestView
from tiered_kv.engine.sampling_params import SamplingParams
from tiered_kv.keys import KeyChain


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not admitted: no blocks yet
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # admitted, an async load is in flight
    RUNNING = "running"  # admitted, prefilling or decoding
    FINISHED = "finished"  # done; blocks freed or held by the connector


class Sequence:
    """A request inside the engine.

    ``num_computed_tokens`` counts the leading tokens whose KV is in the request's device blocks.
    Each step computes ``all_token_ids[num_computed_tokens : num_computed_tokens + n]``; once every
    token is computed the engine samples the next one and appends it.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 key_chain: KeyChain, seed: int) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + generated
        self.sampling_params = sampling_params
        self.key_chain = key_chain  # chained keys of the full blocks of token_ids
        self.seed = seed  # sampling generator seed
        self.status = RequestStatus.WAITING
        self.block_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # device prefix reuse at admission
        self.num_external_tokens = 0  # tokens the connector provided (after any rollback)
        self.num_prefilled_tokens = 0  # prompt tokens this engine computed (recomputes included)
        self.load_async = False
        self.pending_load_blocks: list[int] = []  # connector-loaded blocks not validated yet
        self.load_deadline: float | None = None  # async load: given up on after this (scheduler clock)
        self.state_loaded = False  # its recurrent state came with the loaded blocks (hybrid models)
        self.num_registered_blocks = 0  # leading full blocks published in the device prefix table
        self.num_reported_tokens = 0  # tokens already sent to the connector in a SchedulerOutput
        self.num_reported_blocks = 0  # blocks already sent to the connector
        self.reported_new = False  # appeared in a SchedulerOutput's new_requests
        self.finish_reason: str | None = None
        self.logits: list | None = [] if sampling_params.return_logits else None
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """Tokens whose KV this request may ever need: the last sampled token is never computed."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens - 1

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    # ---- progress ------------------------------------------------------------------------------
    def append_token(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.token_ids.append(int(token_id))
        params = self.sampling_params
        if token_id in params.stop_token_ids:
            self.finish_reason = "stop"
        elif self.num_output_tokens >= params.max_tokens:
            self.finish_reason = "length"

    def view(self, block_ids: tuple | None = None) -> RequestView:
        """``block_ids``: the scheduler's per-group ids when the namespace has KV groups."""
        return RequestView(
            request_id=self.request_id,
            prompt_token_ids=tuple(self.prompt_token_ids),
            all_token_ids=tuple(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            block_ids=tuple(self.block_ids) if block_ids is None else block_ids,
            num_computed_tokens=self.num_computed_tokens,
        )

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
