"""Fault soak (issue 10): crash, corruption, outage, full-disk and sharing scenarios against the
real store, media and reference engine, reported as figures.

    python tools/fault_soak.py [--json] [--quick] [--kills N] [--flips N] [--lies N]
                               [--sections sigkill,corruption,...] [--seed S] [--dir DIR]

Prints ONE JSON object on stdout with ``--json`` (a short human summary goes to stderr without
it, and the JSON still to stdout). Sections (``tools/soak/``):

1. ``sigkill``: a child writes through TieredStore (LMDB, write-behind, periodic flush,
   acknowledging durable keys) and is SIGKILLed at a random moment, ``--kills`` times on one
   store directory; after each kill a reopen, CLI verify and a load of every stored block.
   Must be: ``torn_served`` 0, ``reopen_ok_pct`` 100, ``durable_lost`` 0.
2. ``corruption``: ``--flips`` random byte flips and ``--lies`` self-consistent lying headers
   across LMDB, Redis and file:// tiers, loaded through the store and the connector worker.
   Must be: ``detected_pct`` 100, ``wrong_served`` 0, ``exceptions`` 0, ``host_slots_leaked`` 0.
3. ``redis_outage``: the reference engine with host + Redis tiers while Redis is killed, hung
   (SIGSTOP) and back. Must be: ``engine_errors`` 0, ``outputs_identical`` true; lookup times
   while Redis hangs are reported against the configured deadline.
4. ``disk_full``: write-behind into LMDB under RLIMIT_FSIZE in a child. Must be:
   ``committed_lost`` 0 (and saves keep returning: ``save_exceptions`` 0).
5. ``shared``: two processes on one LMDB directory, two engine processes on one Redis. Must be:
   ``inconsistent`` 0, ``committed_lost`` 0.

Exit status: 0 when every must-be figure holds, 1 when one does not, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
for _p in (str(ROOT), str(TOOLS)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

SECTIONS = ("sigkill", "corruption", "redis_outage", "disk_full", "shared")

# (section, figure, wanted value) — what the soak must show
MUST = [
    ("sigkill", "torn_served", 0), ("sigkill", "reopen_ok_pct", 100.0), ("sigkill", "durable_lost", 0),
    ("corruption", "detected_pct", 100.0), ("corruption", "wrong_served", 0),
    ("corruption", "exceptions", 0), ("corruption", "host_slots_leaked", 0),
    ("redis_outage", "engine_errors", 0), ("redis_outage", "outputs_identical", True),
    ("disk_full", "committed_lost", 0),
    ("shared", "inconsistent", 0), ("shared", "committed_lost", 0),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="only the JSON object (no summary on stderr)")
    ap.add_argument("--quick", action="store_true", help="every section small: well under a minute")
    ap.add_argument("--kills", type=int, help="SIGKILLs (default 200, quick 10)")
    ap.add_argument("--flips", type=int, help="random byte flips (default 1000, quick 90)")
    ap.add_argument("--lies", type=int, help="crafted lying headers (default 100, quick 30)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", help="work directory (default: a temporary one, removed at the end)")
    ap.add_argument("--verbose", action="store_true", help="library logs on stderr")
    args = ap.parse_args(argv)
    full = not args.quick
    args.kills = args.kills if args.kills is not None else (200 if full else 10)
    args.flips = args.flips if args.flips is not None else (1000 if full else 90)
    args.lies = args.lies if args.lies is not None else (100 if full else 30)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown section {unknown[0]!r}; known: {', '.join(SECTIONS)}")
    if min(args.kills, args.flips, args.lies) < 0:
        ap.error("--kills, --flips and --lies must not be negative")
    return args


# -- sections --------------------------------------------------------------------------------------
def section_sigkill(args, work: Path, redis) -> dict:
    from soak import sigkill

    return sigkill.run(work, args.kills, window_s=0.8, budget_s=40 if args.quick else 900,
                       seed=args.seed, keep=400 if args.quick else 1500)


def section_corruption(args, work: Path, redis) -> dict:
    from soak import corruption

    return corruption.run(work, redis.url if redis else None, args.flips, args.lies, args.seed)


def section_redis_outage(args, work: Path, redis) -> dict:
    from soak import outage

    return outage.run(redis, args.seed, rounds=1 if args.quick else 3)


def section_disk_full(args, work: Path, redis) -> dict:
    from soak import disk_full

    if args.quick:
        return disk_full.run(work, blocks=300, limit=2 << 20, codecs=("raw",))
    return disk_full.run(work, blocks=1200, limit=8 << 20, codecs=("raw", "zstd+shuffle"))


def section_shared(args, work: Path, redis) -> dict:
    from soak import shared

    return shared.run(work, redis.url if redis else None, lmdb_rounds=12 if args.quick else 60,
                      engine_rounds=2 if args.quick else 4, seed=args.seed)


RUNNERS: dict[str, Callable] = {
    "sigkill": section_sigkill,
    "corruption": section_corruption,
    "redis_outage": section_redis_outage,
    "disk_full": section_disk_full,
    "shared": section_shared,
}


def needs_redis(sections: list[str]) -> bool:
    return any(s in ("corruption", "redis_outage", "shared") for s in sections)


def run_section(name: str, args, work: Path, redis) -> dict:
    """One section's figures, with its own ``seconds``; a crash of the soak itself becomes an
    ``error`` entry (the section's must-be figures are then missing, and so fail)."""
    t0 = time.monotonic()
    sub = work / name
    sub.mkdir(parents=True, exist_ok=True)
    try:
        figures = RUNNERS[name](args, sub, redis)
    except Exception as exc:  # the soak reports; it does not stop at the first broken section
        logging.getLogger("fault_soak").exception("section %s failed", name)
        figures = {"error": f"{type(exc).__name__}: {exc}"}
    figures["seconds"] = round(time.monotonic() - t0, 2)
    return figures


def checks(report: dict) -> list[dict]:
    """Every must-be figure of the sections that ran: value, wanted value, ok."""
    out = []
    for section, figure, want in MUST:
        if section not in report["sections"]:
            continue
        value = report["sections"][section].get(figure)
        out.append({"section": section, "figure": figure, "value": value, "want": want,
                    "ok": value == want})
    return out


def summary(report: dict) -> str:
    lines = [f"fault soak ({'quick' if report['quick'] else 'full'}): {report['seconds']} s"]
    for name, figures in report["sections"].items():
        lines.append(f"  {name:<13} {figures.get('seconds')} s" + (f"  ERROR {figures['error']}"
                                                                   if "error" in figures else ""))
    for c in report["checks"]:
        mark = "ok  " if c["ok"] else "FAIL"
        lines.append(f"  {mark} {c['section']}.{c['figure']} = {c['value']} (want {c['want']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.CRITICAL,
                        format="%(levelname)s %(name)s: %(message)s")
    import torch

    torch.set_num_threads(1)  # the engines here are tiny; 2 OpenMP threads beside the pool thrash
    t0 = time.monotonic()
    own_dir = args.dir is None
    work = Path(tempfile.mkdtemp(prefix="fault-soak-")) if own_dir else Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    redis = None
    report: dict = {"quick": args.quick, "seed": args.seed, "sections": {}}
    try:
        if needs_redis(args.sections):
            from soak.common import RedisProcess

            redis = RedisProcess(work / "redis").start()
        for name in args.sections:
            report["sections"][name] = run_section(name, args, work, redis)
    finally:
        if redis is not None:
            redis.kill()
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)
    report["seconds"] = round(time.monotonic() - t0, 2)
    report["checks"] = checks(report)
    report["failed"] = [f"{c['section']}.{c['figure']}" for c in report["checks"] if not c["ok"]]
    print(json.dumps(report, default=str))
    if not args.json:
        print(summary(report), file=sys.stderr)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
