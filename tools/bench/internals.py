"""Every internal tiered_kv / storage_backends name the benchmarks import (beyond the public
``TieredStore``, ``TieredKVConfig``, ``Namespace`` / ``block_keys`` and the ``tiered_kv.engine`` /
``tiered_kv.connector`` package APIs), gathered here so a move of the store's modules is fixed in
one place: ``BlockCodec``, its ``HEADER_BYTES``, ``codec_choice`` (what ``auto`` resolves to) and
``smallest_frame`` (the frames it is measured on) for bench_tiers' codec limits, and the methods bench_e2e's probe wraps
to say where TTFT goes (imported only in the e2e child that installs the probe)."""

from __future__ import annotations

from typing import Any

from tiered_kv.store import codec_choice
from tiered_kv.store.codec import HEADER_BYTES, BlockCodec
from tiered_kv.store.layer_frames import smallest_frame

__all__ = ["HEADER_BYTES", "BlockCodec", "codec_choice", "probe_points", "smallest_frame"]


def probe_points() -> list[tuple[Any, str, str]]:
    """(owner, method name, label) of every method the e2e TTFT probe times."""
    from storage_backends.lmdb_disk import LmdbBackend
    from tiered_kv.connector.worker import ConnectorWorker
    from tiered_kv.engine.llm_engine import LLMEngine
    from tiered_kv.engine.model_runner import ModelRunner
    from tiered_kv.engine.scheduler import Scheduler
    from tiered_kv.store import LoadPlan, TieredStore
    from tiered_kv.store.encoded_tier import EncodedTier
    from tiered_kv.store.loading import Loader

    return [
        (LLMEngine, "step", "step"),
        (Scheduler, "schedule", "schedule"),  # includes lookup and lease
        (TieredStore, "lookup", "lookup"),
        (LmdbBackend, "contains_many", "lmdb_contains"),
        (TieredStore, "lease", "lease"),
        (ConnectorWorker, "start_load_kv", "load"),  # submit + wait + scatter
        (LoadPlan, "wait", "load_wait"),
        (Loader, "_load_job", "pool_load_jobs"),  # per transfer thread, summed
        (EncodedTier, "read_into", "pool_tier_read"),  # LMDB visit incl. decode
        (BlockCodec, "decode", "pool_decode"),  # header+checksums+zstd+unshuffle
        (ConnectorWorker, "_scatter", "scatter"),
        (ModelRunner, "run", "forward"),
        (ConnectorWorker, "wait_for_save", "save_gather"),
    ]
