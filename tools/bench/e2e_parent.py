"""bench_e2e's parent side: starting each child process (``tools/bench_e2e.py --child``) and
turning what the children return into the report's sections: ``ttft_section`` (cold runs, warm
restarts with the page cache warm and dropped, alternating order, medians, the warm/cold ratio
against its target, output equality) and ``decode_section`` (per-step times off vs saving, the
overhead from ABBA pairs against its target)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .common import log, median_or_nan
from .e2e_setup import (
    BLOCK_SIZE,
    CHILD_TIMEOUT_S,
    GEN_TOKENS,
    TARGET_FROM,
    TARGET_OVERHEAD_PCT,
    target_ratio,
)

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "tools" / "bench_e2e.py"


def run_child(role: str, spec: dict) -> dict:
    cmd = [sys.executable, str(LAUNCHER), "--child", role, json.dumps(spec)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{role} child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _default_mode(modes: list[str]) -> str:
    """The load mode of the default configuration (``layerwise_loads = "auto"``) on the engine's
    device, when it was measured (else the last mode asked for): whole on a CPU engine. (It was
    always layer-wise, which "auto" never picks on a CPU engine.)"""
    import torch

    from tiered_kv.config import layerwise_on

    mode = "layerwise" if layerwise_on("auto", "cuda" if torch.cuda.is_available() else "cpu") else "whole"
    return mode if mode in modes else modes[-1]


def _summ(runs: list[dict]) -> dict:
    """Median TTFT and the figures of the median run (every run's TTFT listed)."""
    ttfts = [r["ttft_s"] for r in runs]
    mid = sorted(runs, key=lambda r: r["ttft_s"])[(len(runs) - 1) // 2]
    keep = {k: v for k, v in mid.items()
            if k not in ("output", "first_logits", "ttft_s", "probe_missing", "env")}
    return {"ttft_s": round(median_or_nan(ttfts), 4), "runs_s": ttfts, **keep}


def _max_abs_diff(a: list[float] | None, b: list[float] | None) -> float | None:
    if a is None or b is None:
        return None
    return round(max(abs(x - y) for x, y in zip(a, b)), 6)


def ttft_section(args, max_position: int, scratch: str) -> tuple[list[dict], dict]:
    """Every measurement in its own fresh process (a restart's first request pays first-call
    costs -- fresh buffers fault their pages in -- and that is part of what is measured)."""
    rows, env = [], {}
    caches = ["warm"] + ([] if args.no_drop else ["dropped"])
    extra = args.continue_tokens
    # a continuation ("warm+256"): the stored prompt and that many new tokens, nothing saved
    variants = caches + [f"{c}+{extra}" for c in caches if extra]
    for length in args.lengths:
        cold_repeats = args.cold_repeats or (args.repeats if length < TARGET_FROM else 1)
        base = {"length": length, "max_position": max_position, "gen_tokens": GEN_TOKENS}
        with tempfile.TemporaryDirectory(prefix=f"ttft-{length}-", dir=scratch) as d:
            store = str(Path(d) / "store")
            cold_runs = [run_child("serve", {**base, "variant": "cold", "dir": store})]
            env = env or cold_runs[0].pop("env", {})
            for _ in range(1, cold_repeats):  # more cold runs, each on its own empty store
                with tempfile.TemporaryDirectory(prefix="cold-", dir=d) as other:
                    cold_runs.append(run_child("serve", {**base, "variant": "cold",
                                                         "dir": str(Path(other) / "store")}))
            log(f"{length} tokens: cold {[r['ttft_s'] for r in cold_runs]} s", "bench_e2e")
            # every (page cache variant, load mode) pair; the order alternates per repeat
            pairs = [(v, m) for v in variants for m in args.load_modes]
            by_mode: dict[tuple[str, str], list[dict]] = {p: [] for p in pairs}
            for rep in range(args.repeats):
                for variant, mode in (pairs if rep % 2 == 0 else pairs[::-1]):
                    cache, _, more = variant.partition("+")
                    by_mode[variant, mode].append(run_child("serve", {
                        **base, "variant": cache, "extra_tokens": int(more or 0), "dir": store,
                        "layerwise": mode == "layerwise"}))
            main_mode = _default_mode(args.load_modes)
            runs = {v: by_mode[v, main_mode] for v in variants}
            log(f"{length} tokens: " + ", ".join(f"{v}/{m} {[r['ttft_s'] for r in rs]} s"
                                                 for (v, m), rs in by_mode.items()), "bench_e2e")
        reference = cold_runs[0]
        row: dict[str, Any] = {"prompt_tokens": length, "full_blocks": length // BLOCK_SIZE,
                               "claimable_blocks": (length - 1) // BLOCK_SIZE,
                               "cold": _summ(cold_runs), "warm_restart": _summ(runs["warm"])}
        row["cold"]["stored_block_bytes_avg"] = (
            round(reference["disk_stored_bytes"] / reference["disk_blocks_written"])
            if reference["disk_blocks_written"] else None)
        row["ratio_warm_over_cold"] = round(row["warm_restart"]["ttft_s"] / row["cold"]["ttft_s"], 4)
        row["warm_restart_mode"] = main_mode
        row["load_modes"] = {f"{v}/{m}": _summ(rs) for (v, m), rs in by_mode.items()}
        if {"whole", "layerwise"} <= set(args.load_modes):
            row["layerwise_over_whole"] = {v: round(row["load_modes"][f"{v}/layerwise"]["ttft_s"]
                                                    / row["load_modes"][f"{v}/whole"]["ttft_s"], 4)
                                           for v in variants}
        others = cold_runs + [r for (v, _), rs in by_mode.items() if "+" not in v for r in rs]
        if extra:  # continuations: every mode and page cache state answers alike
            more = [r for (v, _), rs in by_mode.items() if "+" in v for r in rs]
            row["continuation"] = {"new_tokens": extra, "computed_tokens": more[0]["prefilled_tokens"],
                                   "outputs_identical": all(r["output"] == more[0]["output"] for r in more)}
        if runs.get("dropped"):
            row["warm_restart_page_cache_dropped"] = _summ(runs["dropped"])
            row["ratio_dropped_over_cold"] = round(
                row["warm_restart_page_cache_dropped"]["ttft_s"] / row["cold"]["ttft_s"], 4)
        row["outputs_identical"] = all(r["output"] == reference["output"] for r in others)
        row["first_token_logits_max_abs_diff"] = max(
            (_max_abs_diff(reference["first_logits"], r["first_logits"]) or 0.0) for r in others)
        row["problems"] = restart_problems(length, by_mode)
        if not row["outputs_identical"]:
            row["problems"].append("a warm restart's output differs from the cold run's")
        if not row.get("continuation", {}).get("outputs_identical", True):
            row["problems"].append("the continuations' outputs differ")
        row["target_ratio"] = target_ratio(length)
        if row["target_ratio"] is not None:
            worst = max(row["ratio_warm_over_cold"], row.get("ratio_dropped_over_cold", 0.0))
            row["pass"] = worst <= row["target_ratio"] and not row["problems"]
        rows.append(row)
    return rows, env


def restart_problems(length: int, by_mode: dict[tuple[str, str], list[dict]]) -> list[str]:
    """What makes warm restarts' TTFT no measure of a restore from the disk tier: a run that did not
    load every stored block of the prompt it can use (the prompt's full blocks, less the last
    token's block when the prompt is all of it), a block served by another tier, or a
    "dropped" run whose store was not out of the page cache when the child started."""
    problems = []
    for (variant, mode), runs in by_mode.items():
        cache, _, more = variant.partition("+")
        blocks = length // BLOCK_SIZE if more else (length - 1) // BLOCK_SIZE
        for i, r in enumerate(runs):
            where = f"{variant}/{mode} run {i + 1}"
            if r["matched_tokens"] != blocks * BLOCK_SIZE:
                problems.append(f"{where}: {r['matched_tokens']} tokens restored, {blocks * BLOCK_SIZE} stored")
            if r["tier_blocks"] != {"disk": blocks}:
                problems.append(f"{where}: blocks served {r['tier_blocks']}, {blocks} expected from disk")
            if cache == "dropped" and not r.get("page_cache", {}).get("cold"):
                problems.append(f"{where}: " + r.get("page_cache", {}).get("not_cold", "page cache drop not checked"))
    return problems


def decode_section(args, max_position: int, scratch: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="decode-", dir=scratch) as d:
        got = run_child("decode", {"batch": args.batch, "prompt_len": args.prompt_len,
                                   "steps": args.decode_steps, "repeats": args.repeats,
                                   "max_position": max_position, "dir": str(Path(d) / "store")})
    runs = got["runs"]
    by_mode: dict[str, list[dict]] = {"off": [], "saving": []}
    for r in runs:
        by_mode[r["mode"]].append(r)

    def stats(rs: list[dict], which: str | None = None) -> dict:
        per_run_median, all_steps = [], []
        for r in rs:
            steps = [t for t, b in zip(r["step_s"], r["block_step"])
                     if which is None or (b if which == "block" else not b)]
            if steps:
                per_run_median.append(median_or_nan(steps))
                all_steps += steps
        all_steps.sort()
        return {"median_ms": round(median_or_nan(per_run_median) * 1e3, 3),
                "mean_ms": round(statistics.fmean(all_steps) * 1e3, 3) if all_steps else None,
                "p90_ms": round(all_steps[int(0.9 * (len(all_steps) - 1))] * 1e3, 3) if all_steps else None,
                "per_run_median_ms": [round(x * 1e3, 3) for x in per_run_median]}

    pairs = []
    for rep in range(args.repeats):
        off = next(r for r in runs if r["rep"] == rep and r["mode"] == "off")
        on = next(r for r in runs if r["rep"] == rep and r["mode"] == "saving")
        pairs.append({"median": median_or_nan(on["step_s"]) / median_or_nan(off["step_s"]),
                      "mean": statistics.fmean(on["step_s"]) / statistics.fmean(off["step_s"]),
                      "cpu": on["cpu_s"] / off["cpu_s"]})
    overhead = (median_or_nan([p["median"] for p in pairs]) - 1) * 100
    mean_overhead = (median_or_nan([p["mean"] for p in pairs]) - 1) * 100
    cpu_overhead = (median_or_nan([p["cpu"] for p in pairs]) - 1) * 100
    out = {
        "batch": args.batch, "prompt_tokens": args.prompt_len, "decode_steps": args.decode_steps,
        "repeats": args.repeats, "order": "ABBA (off/saving alternate which runs first)",
        "off": stats(by_mode["off"]), "saving": stats(by_mode["saving"]),
        "off_block_steps": stats(by_mode["off"], "block"),
        "saving_block_steps": stats(by_mode["saving"], "block"),
        "off_plain_steps": stats(by_mode["off"], "plain"),
        "saving_plain_steps": stats(by_mode["saving"], "plain"),
        "overhead_pct": round(overhead, 2),
        "overhead_pct_of_means": round(mean_overhead, 2),
        "cpu_overhead_pct": round(cpu_overhead, 2),
        "cpu_ms_per_step": {m: [round(r["cpu_s"] / len(r["step_s"]) * 1e3, 3) for r in rs]
                            for m, rs in by_mode.items()},
        "pair_overheads_pct": [round((p["median"] - 1) * 100, 2) for p in pairs],
        "target_pct": TARGET_OVERHEAD_PCT, "pass": overhead <= TARGET_OVERHEAD_PCT,
        "saved_per_run": [r["saved"] for r in by_mode["saving"]],
        "write_behind_drain_after_run_s": [r["write_behind_drain_s"] for r in by_mode["saving"]],
        **got["info"],
    }
    return out
