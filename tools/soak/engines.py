"""The reference engine for the soak: a tiny seeded model, fixed prompts with shared prefixes,
connectors over host + Redis, and calls bounded in time."""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from soak.common import error_text, percentile

MAX_TOKENS = 6
CALL_TIMEOUT_S = 120.0  # a generate() or close() that takes longer counts as an engine error


def model_and_engine():
    from tiered_kv.engine import EngineConfig, ModelConfig

    return ModelConfig.tiny(), EngineConfig(num_blocks=256, max_num_batched_tokens=512)


def prompts(seed: int = 0, n: int = 4) -> list[list[int]]:
    """``n`` prompts of 96-200 tokens; the second shares the first's 160-token prefix."""
    rng = random.Random(seed)
    vocab = model_and_engine()[0].vocab_size

    def tokens(k: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(k)]

    first = tokens(200)
    out = [first, first[:160] + tokens(40)]
    while len(out) < n:
        out.append(tokens(rng.choice((96, 150, 200))))
    return out[:n]


def greedy():
    from tiered_kv.engine import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def engine(connector=None):
    from tiered_kv.engine import LLMEngine

    model, cfg = model_and_engine()
    return LLMEngine(model, cfg, connector, seed=0)


def namespace():
    from tiered_kv.engine import engine_namespace, weights_revision

    model, cfg = model_and_engine()
    return engine_namespace(model, cfg, weights_revision(model, seed=0))


def has_lookup_timeout() -> bool:
    """Whether this tiered_kv has the scheduler-side lookup deadline (``lookup_timeout``)."""
    from tiered_kv.config import TieredKVConfig

    return any(f.name == "lookup_timeout" for f in dataclasses.fields(TieredKVConfig))


def connector_config(redis_url: str, *, lookup_timeout: float = 0.05, host: str = "1MiB") -> dict:
    """Host + Redis (0.5 s timeout, 1 retry), no disk; ``lookup_timeout`` where supported."""
    cfg: dict[str, Any] = {"host": {"capacity": host}, "workers": 2,
                           "remote": {"url": redis_url, "timeout": 0.5, "retries": 1}}
    if has_lookup_timeout():
        cfg["lookup_timeout"] = lookup_timeout
    return cfg


def connector(cfg: dict):
    from tiered_kv.config import TieredKVConfig
    from tiered_kv.connector import build_connector

    return build_connector(TieredKVConfig.from_dict(cfg), namespace())


def bounded(fn: Callable[[], Any], timeout: float = CALL_TIMEOUT_S) -> tuple[Any, str | None]:
    """Run ``fn`` on a daemon thread for at most ``timeout`` s: (result, error text or None)."""
    box: dict = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # reported, not raised: the soak goes on
            box["error"] = error_text(exc)

    thread = threading.Thread(target=target, daemon=True, name="soak-bounded")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return None, f"timed out after {timeout:.0f} s"
    return box.get("result"), box.get("error")


def time_store_lookups(batch: list[list[int]], n: int) -> Callable:
    """A probe: ``n`` calls of the store's own ``lookup`` over the prompts' block keys, timed."""

    def probe(conn) -> dict:
        from tiered_kv.keys import block_keys

        keys = [block_keys(conn.store.namespace, p) for p in batch]
        ms = []
        for i in range(n):
            t0 = time.perf_counter()
            conn.store.lookup(keys[i % len(keys)])
            ms.append((time.perf_counter() - t0) * 1000)
        return {"store_lookup_ms": ms}

    return probe


class LookupTimer:
    """Times every scheduler-side lookup (``get_num_new_matched_tokens``) of a connector."""

    def __init__(self, conn) -> None:
        self.ms: list[float] = []
        inner = conn.scheduler.get_num_new_matched_tokens

        def timed(request, num_computed_tokens):
            t0 = time.perf_counter()
            try:
                return inner(request, num_computed_tokens)
            finally:
                self.ms.append((time.perf_counter() - t0) * 1000)

        conn.scheduler.get_num_new_matched_tokens = timed

    def figures(self) -> dict:
        return {"lookup_ms": list(self.ms)}


def latency(ms: list[float], prefix: str) -> dict:
    """Count, p50, p99 and max of ``ms`` under names starting with ``prefix``."""
    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 2)

    return {f"{prefix}s": len(ms), f"{prefix}_ms_p50": r(percentile(ms, 0.5)),
            f"{prefix}_ms_p99": r(percentile(ms, 0.99)), f"{prefix}_ms_max": r(max(ms, default=None))}


def serve(cfg: dict | None, batch: list[list[int]], on_connector: Callable | None = None,
          probe: Callable | None = None) -> dict:
    """One engine (a fresh connector over ``cfg``, or none) serving ``batch``: outputs,
    external tokens, lookup times, remote misses and every error, each call bounded.
    ``on_connector(conn)`` runs before the engine starts, ``probe(conn) -> dict`` after it
    served (its figures are merged in)."""
    t0 = time.monotonic()
    out: dict[str, Any] = {"errors": []}
    conn, timer = None, None
    if cfg is not None:
        conn, err = bounded(lambda: connector(cfg))
        if err:
            out["errors"].append(f"connector: {err}")
            out["seconds"] = round(time.monotonic() - t0, 2)
            return out
        timer = LookupTimer(conn)
        if on_connector is not None:
            on_connector(conn)
    eng, err = bounded(lambda: engine(conn))
    results, err2 = (None, err) if err else bounded(lambda: eng.generate(batch, greedy()))
    if err2:
        out["errors"].append(f"generate: {err2}")
    if results is not None:
        out["outputs"] = [r.output_token_ids for r in results]
        out["external_tokens"] = sum(r.num_external_tokens for r in results)
    if conn is not None:
        out.update(timer.figures())
        if probe is not None:
            figures, err = bounded(lambda: probe(conn))
            out.update(figures or {})
            if err:
                out["errors"].append(f"probe: {err}")
        tiers = conn.store.metrics.snapshot()["tiers"]
        out["remote_hits"] = tiers.get("remote", {}).get("hits", 0)
        out["remote_misses"] = tiers.get("remote", {}).get("misses", {})
        out["events"] = conn.store.metrics.snapshot()["events"]
        _, err = bounded(conn.close)
        if err:
            out["errors"].append(f"close: {err}")
    out["seconds"] = round(time.monotonic() - t0, 2)
    return out
