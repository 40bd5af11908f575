"""Opening the configured lower tiers: one medium per ``TieredKVConfig.lower_tiers`` entry, in
order, with the settings the config gives it (no torch here: the scheduler-side index opens
the same media)."""

from __future__ import annotations

import contextlib

from storage_backends.base import Backend
from storage_backends.registry import open_backend
from tiered_kv.config import TierConfig, TieredKVConfig


def open_media(config: TieredKVConfig) -> list[tuple[TierConfig, Backend]]:
    """(tier config, opened medium) for every lower tier, in order. Nothing stays open when one
    of them fails to open."""
    opened: list[tuple[TierConfig, Backend]] = []
    try:
        for tier in config.lower_tiers:
            opened.append((tier, open_backend(tier.url, **tier.medium_options())))
    except BaseException:
        for _, backend in opened:
            with contextlib.suppress(Exception):
                backend.close()
        raise
    return opened
