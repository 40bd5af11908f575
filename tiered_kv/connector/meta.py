"""The per-step plan the scheduler half hands the worker half: small, picklable, torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoadSpec:
    """Load ``keys`` into the device blocks ``block_ids`` of one request."""

    request_id: str  # the request the blocks belong to
    keys: tuple[bytes, ...]  # block keys, in token order
    block_ids: tuple[int, ...]  # device block per key
    is_async: bool  # True: completion is reported through get_finished
    tenant: bytes | None = None  # the request's tenant label (keys.tenant_label); None: the namespace's
    rows: tuple[tuple[int, ...], ...] = ()  # namespaces with groups: per key, each token group's block (-1: none)
    state_key: bytes | None = None  # namespaces with state groups: the state entry at the last key
    state_ids: tuple[int, ...] = ()  # per state group: the block the state is written into

    def block_rows(self) -> tuple:
        """What locates each key's parts on the device: a block id, or a row of group blocks."""
        return self.rows or self.block_ids


@dataclass(frozen=True)
class SaveSpec:
    """Save the device blocks ``block_ids`` of one request under ``keys``."""

    request_id: str  # the request the blocks belong to
    keys: tuple[bytes, ...]  # block keys, in token order
    block_ids: tuple[int, ...]  # device block per key
    first_block: int  # index of the first block within the request
    context_block_ids: tuple[int, ...] = ()  # the request's blocks before first_block (its prefix)
    tenant: bytes | None = None  # the request's tenant label (keys.tenant_label); None: the namespace's
    rows: tuple[tuple[int, ...], ...] = ()  # namespaces with groups: per key, each token group's block
    state_key: bytes | None = None  # namespaces with state groups: the state at the end of this step
    state_ids: tuple[int, ...] = ()  # per state group: the block the state is read from

    def block_rows(self) -> tuple:
        """What locates each key's parts on the device: a block id, or a row of group blocks."""
        return self.rows or self.block_ids


@dataclass
class ConnectorMeta:
    """Everything the worker half does in one step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    invalidate: tuple[bytes, ...] = ()  # keys computed over a failed load: every rank withdraws them
    # what the engine computes in this step, for the prefill estimate the worker keeps
    # (tiered_kv.store.restore_costs): new tokens, and attention work (query-key pairs:
    # sum over requests of new * context before + new * (new + 1) / 2)
    step_tokens: int = 0
    step_attention: int = 0
    forget: tuple[str, ...] = ()  # requests the engine may never end nor report (paused): no saves to report

    def is_empty(self) -> bool:
        """No transfers to run (the step's work figures are no transfer)."""
        return not self.loads and not self.saves and not self.invalidate


def save_groups(specs: list[SaveSpec]) -> dict[tuple, tuple[list[tuple[bytes, object]], set[str]]]:
    """``specs`` as one batch per (tenant, state entries or not), for quotas and usage: the
    (key, block id or row of group blocks) pairs to save, and the requests they belong to."""
    groups: dict[tuple, tuple[list[tuple[bytes, object]], set[str]]] = {}
    for spec in specs:
        if spec.keys:
            items, owners = groups.setdefault((spec.tenant, False), ([], set()))
            items.extend(zip(spec.keys, spec.block_rows()))
            owners.add(spec.request_id)
        if spec.state_key:
            items, owners = groups.setdefault((spec.tenant, True), ([], set()))
            items.append((spec.state_key, spec.state_ids))
            owners.add(spec.request_id)
    return groups
