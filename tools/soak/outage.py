"""Section ``redis_outage``: the reference engine with host + Redis tiers (a fresh connector,
so an empty host tier, per phase: hits must come from Redis) serving a fixed set of prompts
while Redis is up, killed, restarted, hung (SIGSTOP: connections accepted, nothing answered),
hung between lookup and load, and continued (SIGCONT). Every phase's greedy outputs are compared
with an engine without a connector; scheduler-side lookups are timed."""

from __future__ import annotations

import time

from soak.common import RedisProcess
from soak.engines import connector_config, has_lookup_timeout, latency, prompts, serve, time_store_lookups

REMOTE_TIMEOUT_S, REMOTE_RETRIES, LOOKUP_TIMEOUT_S = 0.5, 1, 0.05


def _hang_after_first_lease(redis: RedisProcess):
    """A connector hook: the server hangs right after the scheduler leased the first matched
    blocks (a lookup answered, the load is still to come)."""

    def hook(conn) -> None:
        inner = conn.scheduler.update_state_after_alloc

        def wrapped(request, block_ids, num_external_tokens):
            inner(request, block_ids, num_external_tokens)
            if num_external_tokens > 0:
                redis.hang()

        conn.scheduler.update_state_after_alloc = wrapped

    return hook


def run(redis: RedisProcess, seed: int, rounds: int = 1, store_lookups: int = 40) -> dict:
    """Phases in order; each runs the same prompts ``rounds`` times on fresh connectors."""
    batch = prompts(seed)
    cfg = connector_config(redis.url, lookup_timeout=LOOKUP_TIMEOUT_S)
    reference = serve(None, batch)
    phases: dict[str, dict] = {}

    def phase(name: str, hook=None, probe=None) -> dict:
        runs = [serve(cfg, batch, hook, probe) for _ in range(rounds)]
        phases[name] = _merge(runs, reference.get("outputs"))
        return phases[name]

    try:
        phase("warm")  # fills Redis
        phase("warm_hits")
        redis.kill()
        phase("killed")
        redis.start()  # same port, empty
        phase("restarted_fill")
        phase("restarted_hits")
        redis.hang()
        phase("hung", probe=time_store_lookups(batch, store_lookups))
        redis.resume()
        redis.answers(10)
        phase("hung_mid_load", _hang_after_first_lease(redis))
        redis.resume()
        redis.answers(10)
        phase("continued")
    finally:
        redis.resume()
        if redis.proc is None:
            redis.start()
    return _figures(reference, phases)


def _merge(runs: list[dict], want: list | None) -> dict:
    """One phase's runs as one figure set (sums; latencies over every run)."""
    first = runs[0]
    store_ms = [ms for r in runs for ms in r.get("store_lookup_ms", [])]
    return {
        "seconds": round(sum(r["seconds"] for r in runs), 2),
        "errors": [e for r in runs for e in r["errors"]],
        "outputs_identical": want is not None and all(r.get("outputs") == want for r in runs),
        "external_tokens": sum(r.get("external_tokens", 0) for r in runs),
        "remote_hits": sum(r.get("remote_hits", 0) for r in runs),
        "remote_misses": first.get("remote_misses", {}),
        "loads_failed": sum(r.get("events", {}).get("loads_failed", 0) for r in runs),
        **latency([ms for r in runs for ms in r.get("lookup_ms", [])], "lookup"),
        **(latency(store_ms, "store_lookup") if store_ms else {}),
    }


def _figures(reference: dict, phases: dict[str, dict]) -> dict:
    hung = phases.get("hung", {})  # lookups while Redis hangs: the scheduler's and the store's
    errors = reference["errors"] + [f"{n}: {e}" for n, p in phases.items() for e in p["errors"]]
    return {
        "engine_errors": len(errors),
        "outputs_identical": bool(reference.get("outputs")) and all(p["outputs_identical"] for p in phases.values()),
        "lookup_ms_p50": hung.get("lookup_ms_p50"), "lookup_ms_p99": hung.get("lookup_ms_p99"),
        "lookup_ms_max": hung.get("lookup_ms_max"), "hung_lookups": hung.get("lookups"),
        "store_lookup_ms_p50": hung.get("store_lookup_ms_p50"),
        "store_lookup_ms_p99": hung.get("store_lookup_ms_p99"), "hung_store_lookups": hung.get("store_lookups"),
        "deadline": {
            "lookup_timeout_s": LOOKUP_TIMEOUT_S if has_lookup_timeout() else None,
            "lookup_timeout_supported": has_lookup_timeout(),
            "remote_timeout_s": REMOTE_TIMEOUT_S, "remote_retries": REMOTE_RETRIES,
            "worst_call_without_deadline_s": REMOTE_TIMEOUT_S * (REMOTE_RETRIES + 1),
        },
        "errors": errors[:10],
        "phases": phases,
        "phases_run": list(phases),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
