"""bench_e2e's report: the machine, model and setup blocks, the TTFT and decode sections run
through the children, which targets were met, load average and elapsed time; and the rich
tables printed without ``--json``."""

from __future__ import annotations

import os
import time
from typing import Any

from .common import log
from .e2e_parent import decode_section, ttft_section
from .e2e_setup import BLOCK_SIZE, GEN_TOKENS, MAX_BATCHED_TOKENS, model_info
from .machine import e2e_machine


def collect(args, max_position: int, scratch: str, started: float) -> dict:
    """Run the sections (children's temporary stores under ``scratch``); the report object."""
    report: dict[str, Any] = {
        "bench": "tiered-kv end to end: reference engine, demo model, host + LMDB store",
        "machine": e2e_machine(),
        "model": model_info(max_position),
        "setup": {
            "engine": {"block_size": BLOCK_SIZE, "max_num_batched_tokens": MAX_BATCHED_TOKENS,
                       "prefill": f"one step up to {MAX_BATCHED_TOKENS} tokens (no chunking)",
                       "max_position": max_position, "device": "auto"},
            "store": {"host": "2x the KV pool, >= 64 MiB", "disk": "lmdb, codec auto (as resolved in each process), "
                      "write_through, capacity 4 GiB, sync off (flushed before the next process)"},
            "connector": {"load_async": False, "restore_policy": "always",
                          "load_modes": args.load_modes},
            "ttft_generated_tokens": GEN_TOKENS, "lengths": args.lengths, "repeats": args.repeats,
        },
    }
    if not args.skip_ttft:
        report["ttft"], report["env"] = ttft_section(args, max_position, scratch)
    if not args.skip_decode:
        log("decode: off vs saving ...", "bench_e2e")
        report["decode"] = decode_section(args, max_position, scratch)
        d = report["decode"]
        log(f"decode: off {d['off']['median_ms']} ms, saving {d['saving']['median_ms']} ms, "
            f"overhead {d['overhead_pct']}% (pairs {d['pair_overheads_pct']})", "bench_e2e")
    targets = {}
    for row in report.get("ttft", []):
        if row.get("target_ratio") is not None:
            targets[f"ttft_ratio_{row['prompt_tokens']}"] = row["pass"]
    if "decode" in report:
        targets["decode_overhead"] = report["decode"]["pass"]
    report["targets_met"] = targets
    report["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    return report


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    m, model = report["machine"], report["model"]
    console.print(f"{m['cpu']} x{m['cpus']}, torch {report.get('env', {}).get('torch')}, model "
                  f"{model['params_m']}M params ({model['config']['dtype']}), block "
                  f"{model['block_bytes'] // 1024} KiB; elapsed {report['elapsed_s']} s")
    if "ttft" in report:
        table = Table(title="cold vs warm-restart TTFT (medians)")
        for col in ("tokens", "cold s", "warm s", "warm/cold", "cache dropped s", "dropped/cold",
                    "matched", "prefilled", "tiers", "same output"):
            table.add_column(col, justify="right")
        for row in report["ttft"]:
            dropped = row.get("warm_restart_page_cache_dropped", {})
            warm = row["warm_restart"]
            table.add_row(str(row["prompt_tokens"]), f"{row['cold']['ttft_s']:.3f}", f"{warm['ttft_s']:.3f}",
                          f"{row['ratio_warm_over_cold']:.3f}", f"{dropped.get('ttft_s', float('nan')):.3f}",
                          f"{row.get('ratio_dropped_over_cold', float('nan')):.3f}",
                          str(warm["matched_tokens"]), str(warm["prefilled_tokens"]),
                          ",".join(f"{k}:{v}" for k, v in warm["tier_blocks"].items()),
                          "yes" if row["outputs_identical"] else "NO")
        console.print(table)
        modes = Table(title="warm restart: whole-block vs layer-wise loads (median TTFT s)")
        for col in ("tokens", *report["ttft"][0]["load_modes"], "layerwise/whole"):
            modes.add_column(col, justify="right")
        for row in report["ttft"]:
            ratio = row.get("layerwise_over_whole", {})
            modes.add_row(str(row["prompt_tokens"]), *(f"{r['ttft_s']:.3f}" for r in row["load_modes"].values()),
                          " ".join(f"{v} {x:.3f}" for v, x in ratio.items()))
        console.print(modes)
    if "decode" in report:
        d = report["decode"]
        console.print(f"decode step ({d['batch']} x {d['prompt_tokens']}-token prompts, {d['decode_steps']} "
                      f"steps): off {d['off']['median_ms']} ms, saving {d['saving']['median_ms']} ms, "
                      f"overhead {d['overhead_pct']}% (pairs {d['pair_overheads_pct']}; target <= "
                      f"{d['target_pct']}%)")
    console.print(f"targets met: {report['targets_met']}")
