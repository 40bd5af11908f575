"""``tiered-kv demo restart``: the restart-and-resume demonstration."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tiered_kv.cli.render import EXIT_OK, EXIT_PROBLEM
from tiered_kv.errors import ConfigError


def add_parser(sub) -> None:
    demo = sub.add_parser("demo", help="demonstrations")
    demo_sub = demo.add_subparsers(dest="demo", required=True)
    restart = demo_sub.add_parser("restart", help="restart-and-resume: run 1 saves, run 2 (a new process) loads")
    restart.add_argument("--dir", type=Path, default=Path("tiered-kv-demo"),
                         help="work directory; the default store is LMDB in DIR/store (default: %(default)s)")
    restart.add_argument("--store", dest="store_url", help="store URL instead (lmdb:///path, redis://host:port/0)")
    restart.add_argument("--model-dir", help="local model directory (config.json + model.safetensors)")
    restart.add_argument("--prompt-tokens", type=int, default=4000, help="main prompt length (default: %(default)s)")
    restart.add_argument("--corrupt", type=int, default=0, metavar="N",
                         help="flip bytes in N stored blocks between the runs")
    restart.add_argument("--model-size", choices=("demo", "tiny"), default="demo",
                         help="seeded model size without --model-dir (tiny: for quick checks)")
    restart.add_argument("--model", dest="model_kind", choices=("llama", "hybrid", "mla"), default="llama",
                         help="seeded model kind: llama, hybrid (Mamba2 + attention: recurrent state "
                              "stored at block boundaries) or mla (one latent per token) (default: %(default)s)")
    restart.add_argument("--json", action="store_true", help="print one JSON object")
    restart.set_defaults(handler=_cmd_demo_restart)


def _cmd_demo_restart(args: argparse.Namespace) -> int:
    from tiered_kv.cli.demo_run import DemoOptions, run_demo

    if args.prompt_tokens < 700:
        raise ConfigError(f"--prompt-tokens must be at least 700, got {args.prompt_tokens}")
    if args.corrupt < 0:
        raise ConfigError(f"--corrupt must be 0 or more, got {args.corrupt}")
    if args.model_dir and args.model_kind != "llama":
        raise ConfigError("--model-dir loads Llama models; --model hybrid|mla are seeded")
    opts = DemoOptions(args.dir, args.store_url, args.model_dir, args.prompt_tokens, args.corrupt,
                       model_size=args.model_size, model_kind=args.model_kind)
    report = run_demo(opts)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_demo(report)
    return EXIT_OK if report["outputs_identical"] else EXIT_PROBLEM


def _print_demo(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 120)
    table = Table(title=f"restart-and-resume demo ({report['model']} model) — store {report['store']}")
    for col in ("prompt", "tokens", "TTFT run 1 s", "TTFT run 2 s", "run 2 from store (blocks)",
                "run 2 device", "run 2 prefilled", "same output"):
        table.add_column(col, justify="right" if col != "prompt" else "left")
    r1, r2 = report["run1"]["prompts"], report["run2"]["prompts"]
    for name, p2 in r2.items():
        p1 = r1.get(name)
        tiers = ", ".join(f"{t}:{n}" for t, n in sorted(p2["tier_blocks"].items())) or "-"
        table.add_row(name, str(p2["prompt_tokens"]), f"{p1['ttft_s']:.3f}" if p1 else "-",
                      f"{p2['ttft_s']:.3f}", f"{p2['matched_tokens']} ({tiers})",
                      str(p2["device_cached_tokens"]), str(p2["prefilled_tokens"]),
                      ("yes" if p1["output"] == p2["output"] else "NO") if p1 else "new")
    console.print(table)
    console.print(f"TTFT of the {report['main_prompt_tokens']}-token prompt, run 2 / run 1: "
                  f"[bold]{report['ttft_ratio_main_prompt']:.3f}[/bold]; repeated prompts matched "
                  f"{report['repeated_prompt_match_fraction']:.1%} of their full-block tokens")
    if report["model"] == "hybrid":
        console.print(f"run 2 resumed {report['run2']['state_entries_loaded']} prompts from a loaded recurrent "
                      f"state entry (SSM + conv state at the hit's last block)")
    if report["corrupted_blocks"]:
        console.print(f"corrupted {len(report['corrupted_blocks'])} stored blocks between the runs; "
                      f"run 2 misses: {report['run2']['misses']}")
    console.print("outputs identical: " + ("[green]yes[/green]" if report["outputs_identical"] else "[red]NO[/red]"))
