"""The store runtime: the tiered store, its save and load paths, host slots, encoded lower
tiers, the transfer pool, metrics and their export, and the scheduler's read-only index.

``from tiered_kv.store import TieredStore`` is the public entry point. It is resolved lazily:
scheduler-side code imports :mod:`tiered_kv.store.lower_index` without pulling in torch.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "TieredStore": "tiered_kv.store.tiered_store",
    "LoadPlan": "tiered_kv.store.loading",
    "SaveBatch": "tiered_kv.store.saving",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
