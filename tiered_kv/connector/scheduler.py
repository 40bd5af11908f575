"""Scheduler half of the connector: what to load and what to save. Never imports torch.

It keeps, per request, the chained keys of its full blocks and how many of them are stored.
``get_num_new_matched_tokens`` asks the store how many leading blocks after the device prefix
hit some tier holds (side-effect free), capped so the engine always computes the last prompt
token, then claims the part of them whose load is predicted to reach the first token soonest
(:mod:`.restore_policy`: possibly fewer, possibly none). ``update_state_after_alloc`` counts what
that left out, leases the matched blocks and records their loads; ``build_connector_meta`` turns
the step's scheduled tokens into saves of every newly completed full block (prompt and generated
tokens alike), each with the request's block table before it (the worker drops a save whose
prefix holds a block that failed to load), and tells the worker the step's new tokens and
attention work (for the prefill estimate it keeps).

When the engine reports blocks that failed to load (:meth:`ConnectorScheduler.blocks_failed`:
vLLM's ``invalid_block_ids``, aggregated over ranks), the keys of every block planned for saving
after a failed one in a request's block table may hold KV computed over garbage (on another
tensor-parallel rank, whose own loads succeeded): the next step's plan tells every rank to
withdraw them (``invalidate``), and lookups treat them as absent meanwhile. The recomputed KV is
then saved like any other. A request whose promised async load failed is never promised
external tokens again (engines re-match it; promising the same failing blocks would loop).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from tiered_kv.connector.block_index import BlockIndex, locate, present
from tiered_kv.connector.group_rows import GroupRows
from tiered_kv.connector.held_saves import HeldSaves
from tiered_kv.connector.meta import ConnectorMeta, LoadSpec, SaveSpec
from tiered_kv.connector.restore_policy import Decision, RestorePolicy
from tiered_kv.keys import KeyChain, Namespace, tenant_label
from tiered_kv.store.restore_costs import attention_work

log = logging.getLogger(__name__)

SUSPECT_STEPS = 4  # plans a withdrawn key stays absent for lookups (async schedulers run ahead)
# plans a request's life is kept for a late report of failed blocks: a finished one's to the next
# plan (same engine update), a preempted one's to the one after (async scheduling runs ahead)
FINISHED_PLANS, PREEMPTED_PLANS = 1, 2
NOT_YET = 1 << 62  # a block index no request reaches: none saved / planned yet


@dataclass
class _Request:
    chain: KeyChain
    tokens: list[int]
    block_ids: list[int] = field(default_factory=list)  # with groups: one id per block (GroupRows.ref)
    groups: GroupRows | None = None  # namespaces with groups: every group's block ids
    external: int = 0  # tokens matched externally at allocation
    saved: int = NOT_YET  # leading blocks already stored (or being stored)
    planned: int = 0  # blocks planned for saving so far (withdrawn when a block before failed)
    first_planned: int = NOT_YET  # the first block planned for saving (those before were loaded or cached)
    had_saves: bool = False  # whether any save was planned (request_finished holds blocks)
    promised: bool = False  # an async load was promised and has not been seen to complete
    no_loads: bool = False  # a promised load failed: claim nothing more for this request
    tenant: bytes | None = None  # the request's own tenant (cache_salt), for quotas and usage


class ConnectorScheduler:
    """Engine-neutral scheduler half over a :class:`BlockIndex` (a TieredStore). ``restore``: the
    restore policy (default: the one ``index`` is configured for, :meth:`RestorePolicy.for_index`,
    for an engine whose KV cache lives on ``device``, a device type; None: not known yet)."""

    def __init__(self, index: BlockIndex, namespace: Namespace, *, load_async: bool = False,
                 save: bool = True, restore: RestorePolicy | None = None, device: str | None = None) -> None:
        self.index = index
        self.restore = restore or RestorePolicy.for_index(index, namespace, load_async=load_async, device=device)
        self._decisions: dict[str, Decision] = {}  # request -> its last claim's decision
        self.namespace, self.block_size, self.grouped = namespace, namespace.block_size, bool(namespace.groups)
        self.load_async, self.save_enabled = load_async, save
        self._requests: dict[str, _Request] = {}
        self._matched_from: dict[str, int] = {}  # request -> first block of the last match
        self._loads: list[LoadSpec] = []
        self._invalidate: list[bytes] = []  # keys to withdraw in the next step's plan
        self._forget: list[str] = []  # paused requests the next plan tells the workers to forget
        self._suspect: dict[bytes, int] = {}  # withdrawn keys -> steps they still count as absent
        # lives of requests finished (vLLM's fail policy) or preempted before vLLM reported their
        # failed blocks, as they were, and the plans they are kept for (*_PLANS)
        self._gone: dict[str, tuple[_Request, int]] = {}
        self._held = HeldSaves(namespace)  # saves of no_save steps, handed out one plan later

    # -- keys ----------------------------------------------------------------------------------
    def _state(self, request_id: str, tokens: Sequence[int], extra: str | None = None,
               tenant: bytes | None = None) -> _Request:
        state = self._requests.get(request_id)
        if state is None:
            chain = KeyChain(self.namespace, lora=extra)
            state = self._requests[request_id] = _Request(chain, list(tokens), tenant=tenant)
        elif len(tokens) > len(state.tokens):
            state.tokens = list(tokens)
        state.chain.update(state.tokens)
        return state

    def keys_of(self, request_id: str) -> list[bytes]:
        return self._requests[request_id].chain.keys

    def held_saves(self) -> list[SaveSpec]:
        """Saves planned in ``no_save`` steps, for the next plan (:mod:`.held_saves`)."""
        return self._held.pending()

    def external_tokens(self, request_id: str) -> int:
        """Tokens matched externally when the request's blocks were allocated (0 if unknown)."""
        state = self._requests.get(request_id)
        return state.external if state is not None else 0

    # -- engine calls ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """External tokens beyond ``num_computed_tokens``; never the last prompt token."""
        state = self._state(request.request_id, request.prompt_token_ids, _extra(request), _tenant(request))
        self._decisions.pop(request.request_id, None)
        if state.promised:  # matched again after a promise: its load failed (see module doc)
            state.promised, state.no_loads = False, True
            log.warning("request %s: its promised load failed; it is recomputed, not matched again",
                        request.request_id)
        bs = self.block_size
        first = num_computed_tokens // bs
        last = (request.num_prompt_tokens - 1) // bs  # blocks we may claim
        if num_computed_tokens % bs or first >= last or state.no_loads:
            return 0, False
        n = self.index.lookup(state.chain.keys[first:last])
        if self._suspect:
            n = next((i for i, k in enumerate(state.chain.keys[first : first + n]) if k in self._suspect), n)
        keys, cuts = state.chain.keys[first : first + n], None
        if n and self.namespace.has_state:
            cuts = self._state_cuts(keys)
            n = cuts[-1] if cuts else 0
        self._matched_from[request.request_id] = first
        decision = self.restore.decide(n, lambda: locate(self.index, keys[:n]), first * bs,
                                       request.num_prompt_tokens, cuts)
        self._decisions[request.request_id] = decision
        if decision.load_blocks == 0:
            return 0, False
        return decision.load_blocks * bs, self.load_async

    def _state_cuts(self, keys: Sequence[bytes]) -> list[int]:
        """The prefixes of ``keys`` whose last block has a state entry, by length (a hybrid model
        resumes only where the recurrent layers' state is held)."""
        state_keys = [self.namespace.state_key(k) for k in keys]
        held = present(self.index, state_keys)
        return [i + 1 for i in range(len(keys)) if held[i] and state_keys[i] not in self._suspect]

    def _set_blocks(self, state: _Request, block_ids) -> None:
        if self.grouped:
            state.groups = GroupRows(self.namespace.groups, block_ids)
            state.block_ids = state.groups.refs()
        else:
            state.block_ids = list(block_ids)

    def _add_blocks(self, state: _Request, block_ids) -> None:
        if self.grouped:
            if state.groups is None:
                state.groups = GroupRows(self.namespace.groups, [[] for _ in self.namespace.groups])
            state.groups.extend(block_ids)
            state.block_ids = state.groups.refs()
        else:
            state.block_ids.extend(block_ids)

    def update_state_after_alloc(self, request, block_ids: Sequence[int], num_external_tokens: int) -> None:
        state = self._state(request.request_id, request.prompt_token_ids, _extra(request), _tenant(request))
        if state.planned:  # a new life of a request resumed without a preemption seen here (vLLM's reset)
            self._new_life(request.request_id, state)
        self._set_blocks(state, block_ids)
        decision = self._decisions.pop(request.request_id, None)
        if decision is not None:  # once per allocation (the engine may have asked several times)
            self.restore.settle(decision, request.request_id)
        if num_external_tokens <= 0:
            state.promised = False  # (engines call again with 0 once an async load completed)
            return
        bs = self.block_size
        first = self._matched_from.pop(request.request_id, 0)
        n = num_external_tokens // bs
        keys = state.chain.keys[first : first + n]
        state.external = num_external_tokens
        state.promised = self.load_async
        extra: dict = {}
        if state.groups is not None:  # blocks the engine keeps in no group are not loaded
            wanted = [i for i in range(first, first + n) if state.groups.row(i) is not None]
            keys = [state.chain.keys[i] for i in wanted]
            extra["rows"] = tuple(state.groups.row(i) for i in wanted)
            block_ids = tuple(state.block_ids[i] for i in wanted)
            if self.namespace.has_state:
                extra["state_key"] = self.namespace.state_key(state.chain.keys[first + n - 1])
                extra["state_ids"] = state.groups.state_ids()
        else:
            block_ids = tuple(state.block_ids[first : first + n])
        leased = list(keys) + ([extra["state_key"]] if "state_key" in extra else [])
        self.index.lease(request.request_id, leased, state.tenant)
        self._loads.append(LoadSpec(request.request_id, tuple(keys), block_ids, self.load_async,
                                    tenant=state.tenant, **extra))

    def blocks_failed(self, block_ids) -> None:
        """The engine reports device blocks whose load failed: withdraw, on every rank, the keys
        of blocks planned for saving after one of them in a request's block table."""
        failed = set(block_ids)
        if not failed:
            return
        keys: list[bytes] = []
        for state in [*self._requests.values(), *(gone for gone, _ in self._gone.values())]:
            first = next((i for i, b in enumerate(state.block_ids) if b in failed), None)
            if first is None:
                continue
            start = max(first + 1, state.first_planned)  # (not the blocks it loaded)
            keys.extend(state.chain.keys[start : state.planned])
            if self.namespace.has_state:  # states it saved at or after the failed block
                keys.extend(self.namespace.state_key(k)
                            for k in state.chain.keys[max(first, state.first_planned) : state.planned])
        if keys:
            log.info("%d saved blocks were computed over %d failed blocks: withdrawing them",
                     len(keys), len(failed))
            self._invalidate.extend(keys)
            self._suspect.update(dict.fromkeys(keys, SUSPECT_STEPS))
        self._held.drop_failed(failed)

    def build_connector_meta(self, scheduler_output) -> ConnectorMeta:
        meta = ConnectorMeta(loads=self._loads, invalidate=tuple(dict.fromkeys(self._invalidate)),
                             forget=tuple(self._forget))
        self._loads, self._invalidate, self._forget = [], [], []
        self._gone = {rid: (state, n - 1) for rid, (state, n) in self._gone.items() if n > 1}
        if self._suspect:  # withdrawn by the workers once they ran the plans that carried them
            self._suspect = {k: n - 1 for k, n in self._suspect.items() if n > 1}
        for spec, finished in self._held.release():
            meta.saves.append(spec)
            if not finished and spec.request_id in self._requests:  # (running on: held when it finishes)
                self._requests[spec.request_id].had_saves = True
        for rd in scheduler_output.new_requests:
            state = self._state(rd.request_id, rd.new_tokens)
            if _any_ids(rd.new_block_ids):
                self._set_blocks(state, rd.new_block_ids)
            _count_work(meta, rd.computed_position + state.external, rd.num_scheduled_tokens)
            self._plan_saves(meta, state, rd, rd.computed_position + state.external)
        for rd in scheduler_output.cached_requests:
            state = self._requests.get(rd.request_id)
            _count_work(meta, rd.computed_position, rd.num_scheduled_tokens)
            if state is None:
                continue
            state.tokens.extend(rd.new_tokens)
            self._add_blocks(state, rd.new_block_ids)
            state.chain.update(state.tokens)
            self._plan_saves(meta, state, rd, rd.computed_position)
        return meta

    def _plan_saves(self, meta: ConnectorMeta, state: _Request, rd, computed_before: int) -> None:
        """Save the blocks that this step completes. A rolled-back request (recompute after a
        failed load) moves ``saved`` back so the recomputed blocks are saved again. A step marked
        ``no_save`` holds its saves for the next plan (:mod:`.held_saves`)."""
        request_id, scheduled = rd.request_id, rd.num_scheduled_tokens
        bs = self.block_size
        state.saved = min(state.saved, computed_before // bs)
        full = min((computed_before + scheduled) // bs, len(state.chain.keys), len(state.block_ids))
        if state.groups is not None:  # a block some token group no longer keeps cannot be stored
            full = state.saved + next((i for i, r in enumerate(state.groups.full_rows(state.saved, full))
                                       if r is None), full - state.saved)
        # only a step that computed tokens leaves a state (a step admitting an async load has not
        # filled the state slot yet)
        extra = self._state_save(state, computed_before + scheduled) if self.save_enabled and scheduled else {}
        if not self.save_enabled or (full <= state.saved and not extra):
            return
        first = min(state.saved, full)
        if state.groups is not None:
            extra["rows"] = tuple(state.groups.full_rows(first, full))
        spec = SaveSpec(request_id, tuple(state.chain.keys[first:full]), tuple(state.block_ids[first:full]),
                        first, context_block_ids=tuple(state.block_ids[:first]), tenant=state.tenant, **extra)
        if getattr(rd, "no_save", False):
            self._held.hold(spec)
        else:
            meta.saves.append(spec)
            state.had_saves = True
        state.saved = max(state.saved, full)
        state.planned = max(state.planned, full)
        state.first_planned = min(state.first_planned, first)

    def _state_save(self, state: _Request, end: int) -> dict:
        """The state entry a step ending at token ``end`` leaves, when ``end`` is a block boundary."""
        if not self.namespace.has_state or end % self.block_size or state.groups is None:
            return {}
        block = end // self.block_size - 1
        if not 0 <= block < len(state.chain.keys) or not state.groups.state_ids():
            return {}
        return {"state_key": self.namespace.state_key(state.chain.keys[block]),
                "state_ids": state.groups.state_ids()}

    def request_preempted(self, request_id: str) -> None:
        """The engine freed the request's device blocks and will schedule it again later (it is
        then matched and allocated anew). Its stored blocks stay stored; a load not started yet
        is dropped with its lease."""
        state = self._requests.get(request_id)
        if state is not None:
            self._new_life(request_id, state)
            state.block_ids, state.external = [], 0
            state.promised = state.no_loads = False
        self._matched_from.pop(request_id, None)
        self._decisions.pop(request_id, None)
        self._drop_loads(request_id)

    def request_paused(self, request_id: str) -> None:
        """Preempted, and forgotten (a new request if it comes back): an engine that may never end
        it nor tell us (TensorRT-LLM passes a request cancelled while paused to no connector call)."""
        self.request_preempted(request_id)
        self._requests.pop(request_id, None)
        self._forget.append(request_id)

    def _new_life(self, request_id: str, state: _Request) -> None:
        """Keep ``state``'s saves so far for a late failure report; plan saves afresh (from the new life's hit)."""
        self._gone[request_id] = (replace(state), PREEMPTED_PLANS)
        self._held.drop(request_id)  # (its blocks went back)
        state.planned, state.first_planned, state.saved = 0, NOT_YET, NOT_YET

    def _drop_loads(self, request_id: str) -> None:
        if any(spec.request_id == request_id for spec in self._loads):
            self._loads = [s for s in self._loads if s.request_id != request_id]
            self.index.drop_lease(request_id)

    def request_finished(self, request, block_ids: Sequence[int]) -> bool:
        """True when saves were planned: the worker reports the id once its copies are done."""
        state = self._requests.pop(request.request_id, None)
        if state is not None:
            self._gone[request.request_id] = (state, FINISHED_PLANS)
        self._matched_from.pop(request.request_id, None)
        self._decisions.pop(request.request_id, None)
        self._drop_loads(request.request_id)
        return bool(state and state.had_saves) | self._held.finished(request.request_id)


def _any_ids(block_ids) -> bool:
    """Whether a step names any block (a flat list, or one list per group)."""
    return any(_any_ids(b) if isinstance(b, (list, tuple)) else True for b in block_ids or ())


def _count_work(meta: ConnectorMeta, context: int, scheduled: int) -> None:
    """Add one request's part of the step to the work the worker times (:mod:`.restore_policy`)."""
    if scheduled > 0:
        meta.step_tokens += scheduled
        meta.step_attention += attention_work(max(context, 0), scheduled)


def _tenant(request) -> bytes | None:
    """The tenant label of a request that names its own tenant (vLLM's ``cache_salt``), when the
    engine adapter's request view carries ``tenant``; None: the namespace's tenant."""
    tenant = getattr(request, "tenant", None)
    return None if tenant in (None, "") else tenant_label(str(tenant))


def _extra(request) -> str | None:
    """Per-request bytes folded into every key (LoRA adapter, tenant salt), when the engine
    adapter's request view carries ``key_extra``."""
    extra = getattr(request, "key_extra", None)
    return None if extra in (None, "") else str(extra)
