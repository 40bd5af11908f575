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


@dataclass(frozen=True)
class SaveSpec:
    """Save the device blocks ``block_ids`` of one request under ``keys``."""

    request_id: str  # the request the blocks belong to
    keys: tuple[bytes, ...]  # block keys, in token order
    block_ids: tuple[int, ...]  # device block per key
    first_block: int  # index of the first block within the request
    context_block_ids: tuple[int, ...] = ()  # the request's blocks before first_block (its prefix)
    tenant: bytes | None = None  # the request's tenant label (keys.tenant_label); None: the namespace's


@dataclass
class ConnectorMeta:
    """Everything the worker half does in one step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    invalidate: tuple[bytes, ...] = ()  # keys computed over a failed load: every rank withdraws them

    def is_empty(self) -> bool:
        return not self.loads and not self.saves and not self.invalidate
