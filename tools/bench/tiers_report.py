"""bench_tiers' report: the one JSON object (machine, settings with the codecs the store writes,
cache eviction, per block size the limits, store figures, compression and store info, the target
ratios, load average and elapsed time), printed either as JSON (lists of numbers kept on one line)
or as rich tables."""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import TYPE_CHECKING

from .common import Stopwatch, median
from .data import SIZES
from .machine import tiers_machine
from .targets import ratios
from .tiers import WORKERS

if TYPE_CHECKING:
    from .tiers_main import Bench


def build_report(b: Bench, started: Stopwatch, load_start: tuple) -> dict:
    sizes = {}
    for size in SIZES:
        d0 = b.data[size][0]
        entry: dict = {"shape": list(d0.shape), "dtype": "bfloat16", "block_bytes": d0.numel() * 2,
                       "blocks": len(b.data[size]), "batch": SIZES[size]["batch"],
                       "total_bytes": len(b.data[size]) * d0.numel() * 2}
        entry["compression"] = b.compression.get(size, {})
        entry["limits"] = {n.split(".", 1)[1]: b.fig.get(size, n) for n in b.fig.names(size)
                           if n.startswith("limits.") and b.fig.get(size, n) is not None}
        entry["store"] = {n.split(".", 1)[1]: b.fig.get(size, n) for n in b.fig.names(size)
                          if n.startswith("store.") and b.fig.get(size, n) is not None}
        if size in b.redis_bench:
            rb = b.redis_bench[size]
            entry["limits"]["redis_benchmark"] = {
                op: {"gbps": median([r[op]["gbps"] for r in rb if op in r]),
                     "runs_gbps": [r[op]["gbps"] for r in rb if op in r]}
                for op in ("set", "get", "set_new_keys") if any(op in r for r in rb)} or rb[0]
        entry["store_info"] = b.store_info.get(size, {})
        sizes[size] = entry
    rows = ratios(b.fig, b.compression)
    targets = [r for r in rows if not r.get("extra") and r["pass"] is not None]
    return {
        "bench": "tiered-kv tiers vs machine limits",
        "machine": tiers_machine(b.base),
        "settings": {
            "blocks_2MiB": len(b.data["2MiB"]), "blocks_64KiB": len(b.data["64KiB"]),
            "repeats": b.args.repeats, "quick": b.args.quick, "dir": b.base,
            "store_workers": WORKERS,
            "codec": {"disk": b.codec_name, "remote": b.remote_codec[0]},  # what the store writes
            "codec_level": {"disk": b.codec_level, "remote": b.remote_codec[1]},
            "codec_setting": b.codec_setting,  # as configured ("auto": resolved for this machine)
            "redis": b.redis_url and (("own redis-server at " + b.redis_url) if b.redis
                                      else "given: " + b.redis_url),
            "redis_error": b.redis_error,
            "figures": "medians over repeats; gbps = 1e9 payload bytes/s; "
                       "ratio = store median / bound median",
        },
        "cache_eviction": {"method": b.evictor.method, "drop_caches": b.evictor.drop_caches,
                           "resident_fraction_after_evict": b.residency},
        "sizes": sizes,
        "ratios": rows,
        "targets_passed": sum(r["pass"] for r in targets),
        "targets_total": len(targets),
        "loadavg": {"start": list(load_start), "end": list(os.getloadavg())},
        "elapsed_s": round(started.lap()[0], 1),
        "process_cpu_cores": round(started.lap()[1] / started.lap()[0], 2),
    }


def print_json(report: dict) -> None:
    # one object; lists of numbers stay on one line so the figures read as a table
    text = json.dumps(report, indent=1)
    print(re.sub(r"\[\s*([-0-9.eE, \n]*?)\s*\]",
                 lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]"
                 if m.group(1).strip() else "[]", text))


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(160, shutil.get_terminal_size((160, 40)).columns))
    m = report["machine"]
    console.print(f"[bold]{report['bench']}[/] — {m['cpus']} CPUs ({m['cpu_model']}), {m['mem_gib']} GiB, "
                  f"torch {m['torch']} ({m['torch_threads']} threads), {m['bench_dir_fs']}; "
                  f"cache eviction: {report['cache_eviction']['method']} "
                  f"(drop_caches: {report['cache_eviction']['drop_caches']})")
    for size, entry in report["sizes"].items():
        t = Table(title=f"{size} blocks {entry['shape']} bf16 x {entry['blocks']} "
                        f"(compression {entry['compression']})")
        for col in ("figure", "GB/s", "blocks/s", "runs GB/s", "CPU cores", "note"):
            t.add_column(col, justify="right" if col in ("GB/s", "blocks/s") else "left")
        for group in ("limits", "store"):
            for name, f in entry[group].items():
                if f is None:
                    continue
                if "error" in f:
                    t.add_row(f"{group}.{name}", "-", "-", "", "", f"[red]{f['error']}[/]")
                    continue
                if "gbps" not in f:  # redis-benchmark
                    for op, g in f.items():
                        if isinstance(g, dict) and "gbps" in g:
                            t.add_row(f"{group}.{name}.{op}", f"{g['gbps']:.2f}", "",
                                      " ".join(f"{x:.2f}" for x in g.get("runs_gbps", [])), "", "")
                    continue
                note = f.get("what", f.get("codec", ""))
                t.add_row(f"{group}.{name}", f"{f['gbps']:.2f}", f"{f['blocks_per_s']:.0f}",
                          " ".join(f"{x:.2f}" for x in f["runs_gbps"]),
                          "" if f.get("cpu_cores") is None else f"{f['cpu_cores']:.2f}", note[:80])
        console.print(t)
    codec, setting = report["settings"]["codec"], report["settings"]["codec_setting"]
    console.print("codec the store writes: " + ", ".join(
        f"{tier} {codec[tier]}" + (f" ({setting[tier]})" if setting[tier] != codec[tier] else "")
        for tier in codec))
    t = Table(title=f"targets: {report['targets_passed']}/{report['targets_total']} pass (ratios of GB/s "
                    "to limits measured in the same run; context rows are not targets: the naive "
                    "baseline, and which of codec / medium bounds a tier)")
    for col in ("size", "kind", "name", "store / bound", "store", "bound", "ratio", "paired", "need", "pass"):
        t.add_column(col, no_wrap=True, justify="right" if col in ("store", "bound", "ratio", "paired") else "left")
    notes = []
    for r in sorted(report["ratios"], key=lambda r: bool(r.get("extra"))):  # targets first
        verdict = "[dim]n/a[/]" if r["pass"] is None else "[green]yes[/]" if r["pass"] else "[red]no[/]"
        note = r.get("skipped") or r.get("error")
        if r["ratio"] is None and note:
            notes.append(f"{r['size']} {r['name']}: {note}")
        t.add_row(r["size"], "context" if r.get("extra") else "target", r["name"],
                  short(r["store"]) + (f" / {short(r['bound'])}" if r["bound"] else ""),
                  gbps(r.get("store_gbps")), gbps(r.get("bound_gbps")),
                  "-" if r["ratio"] is None else f"{r['ratio']:.3f}",
                  "" if r.get("ratio_paired_median") is None else f"{r['ratio_paired_median']:.3f}",
                  f"≥{r['target']}", verdict)
    console.print(t)
    for note in notes:
        console.print(f"  {note}")
    console.print(f"elapsed {report['elapsed_s']} s, load average {report['loadavg']}")


def short(figure: str) -> str:
    """A figure's name without its group: ``store.host_save`` -> ``host_save``."""
    return " ".join(w.split(".", 1)[-1] for w in figure.split(" "))


def gbps(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
