"""bench_e2e's command line and entry point: the options (``--quick`` for a smoke run), a child
process's dispatch (``--child ROLE SPEC``, run by the parent through ``tools/bench_e2e.py``), and
the parent's run: a scratch directory for the children's stores, the report, JSON or tables."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from .e2e_report import collect, print_table

DESCRIPTION = "End-to-end benchmark on the reference engine: cold vs warm-restart TTFT, and decode overhead."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--lengths", default="512,2048,8192",
                        help="prompt lengths (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="warm restarts per length and decode off/on pairs (default: %(default)s)")
    parser.add_argument("--cold-repeats", type=int, default=0,
                        help="cold runs per length (default: --repeats below 4096 tokens, 1 from 4096 on)")
    parser.add_argument("--decode-steps", type=int, default=128,
                        help="decode steps per run (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=4, help="decode batch (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=512,
                        help="decode prompt tokens (default: %(default)s)")
    parser.add_argument("--dir", default=None,
                        help="where temporary stores go (default: the system temp dir)")
    parser.add_argument("--no-drop", action="store_true", help="skip the page-cache-dropped restarts")
    parser.add_argument("--load-modes", default="whole,layerwise",
                        help="warm restarts with whole-block and/or layer-wise loads (default: %(default)s)")
    parser.add_argument("--continue-tokens", type=int, default=256,
                        help="warm restarts also serve the stored prompt followed by this many new tokens "
                             "(a continuation: restore beside compute); 0 = off (default: %(default)s)")
    parser.add_argument("--skip-ttft", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--skip-decode", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 512 and 2048 tokens, 1 repeat, 32 decode steps")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.repeats, args.decode_steps, args.cold_repeats = "512,2048", 1, 32, 1
    args.lengths = [int(x) for x in str(args.lengths).split(",") if x.strip()]
    args.load_modes = [m for m in str(args.load_modes).split(",") if m.strip()]
    if not args.load_modes or set(args.load_modes) - {"whole", "layerwise"}:
        parser.error("--load-modes: whole and/or layerwise")
    if args.repeats < 1 or args.decode_steps < 1 or not args.lengths or args.continue_tokens < 0:
        parser.error("--repeats and --decode-steps must be positive, --continue-tokens not negative "
                     "and --lengths not empty")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        import logging

        from .e2e_child import CHILDREN

        logging.basicConfig(level=logging.WARNING)
        role, spec = args.child[0], json.loads(args.child[1])
        result = CHILDREN[role](spec)
        print(json.dumps(result))
        return
    started = time.perf_counter()
    max_position = max([n + args.continue_tokens for n in args.lengths] + [args.prompt_len + args.decode_steps]) + 256
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="bench-e2e-", dir=args.dir)
    try:
        report = collect(args, max_position, scratch, started)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_table(report)
