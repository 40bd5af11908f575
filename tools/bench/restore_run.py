"""bench_restore's two sides. The child (``--child SPEC``) builds the reference engine (bench_e2e's
demo model and engine configuration) with a connector on the store config it is given and
serves one prompt under one restore policy, fresh process, host tier empty; it reports the TTFT,
what was loaded and what the policy skipped. The parent starts the media (a redis-server behind
a throttled proxy: the slow remote; LMDB: the fast disk), runs the children and summarizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import log, median_or_nan
from .e2e_setup import CHILD_TIMEOUT_S, GEN_TOKENS, build_engine, prompt_tokens, warm_up

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "tools" / "bench_restore.py"


def child(spec: dict) -> dict:
    from tiered_kv.config import TieredKVConfig
    from tiered_kv.engine import SamplingParams

    length = spec["length"]
    config = TieredKVConfig.from_dict({**spec["store"], "restore_policy": spec["policy"]})
    engine, connector = build_engine(spec["max_position"], length + GEN_TOKENS, config)
    try:
        warm_up(engine)
        params = SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0)
        [out] = engine.generate([prompt_tokens(length, seed=length)], params)
        engine.drain(30.0)
        tiers = dict(connector.worker.load_stats.get(out.request_id, {}))
        connector.store.flush()
        snap = connector.store.metrics.snapshot()
    finally:
        connector.close()
    return {"ttft_s": round(out.ttft_s, 4), "matched_tokens": out.num_external_tokens,
            "prefilled_tokens": out.num_prefilled_tokens, "tier_blocks": tiers,
            "misses": {r: n for t in snap["tiers"].values() for r, n in t["misses"].items()},
            "events": snap["events"], "output": out.output_token_ids}


def run_child(spec: dict) -> dict:
    cmd = [sys.executable, str(LAUNCHER), "--child", json.dumps(spec)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def scenario(name: str, store: dict, length: int, repeats: int, max_position: int, scratch: str) -> dict:
    """Cold (= recompute: an empty store) runs, then warm restarts under ``always`` and ``cost``
    alternating (one ``always`` first: the estimates need one observed restore of the tier)."""
    base = {"length": length, "max_position": max_position}
    runs: dict[str, list[dict]] = {"recompute": [], "always": [], "cost": []}
    with tempfile.TemporaryDirectory(prefix=f"{name}-", dir=scratch) as d:
        spec_store = json.loads(json.dumps(store).replace("{DIR}", d))
        runs["recompute"].append(run_child({**base, "store": spec_store, "policy": "always"}))
        order = ["always", "cost"]
        for rep in range(repeats):
            for policy in (order if rep % 2 == 0 else order[::-1]):
                runs[policy].append(run_child({**base, "store": spec_store, "policy": policy}))
        for _ in range(1, repeats):  # more recompute figures, each on an empty store of its own
            with tempfile.TemporaryDirectory(prefix="cold-", dir=d) as other:
                alone = json.loads(json.dumps(store).replace("{DIR}", other))
                if "remote" in alone:  # an empty remote of its own is not at hand: no lower tier
                    alone = {k: v for k, v in alone.items() if k != "remote"}
                runs["recompute"].append(run_child({**base, "store": alone, "policy": "always"}))
    reference = runs["recompute"][0]["output"]
    out = {"scenario": name, "prompt_tokens": length}
    for policy, rs in runs.items():
        mid = sorted(rs, key=lambda r: r["ttft_s"])[(len(rs) - 1) // 2]
        out[policy] = {"ttft_s": round(median_or_nan([r["ttft_s"] for r in rs]), 4),
                       "runs_s": [r["ttft_s"] for r in rs], "matched_tokens": mid["matched_tokens"],
                       "tier_blocks": mid["tier_blocks"],
                       "skipped_slower_than_recompute": mid["misses"].get("slower_than_recompute", 0)}
    out["outputs_identical"] = all(r["output"] == reference for rs in runs.values() for r in rs)
    best = min(out["recompute"]["ttft_s"], out["always"]["ttft_s"])
    out["cost_over_best_of_both"] = round(out["cost"]["ttft_s"] / best, 4)
    log(f"{name} {length}: " + ", ".join(f"{p} {out[p]['ttft_s']} s" for p in runs), "bench_restore")
    return out
