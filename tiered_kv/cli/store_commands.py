"""Read-only store commands: ``inspect``, ``ls``, ``show``, ``explain``."""

from __future__ import annotations

import argparse
import time

from rich.markup import escape

from tiered_kv.admin.tenants import NO_TENANT
from tiered_kv.cli import render
from tiered_kv.cli.options import add_store_args, duration_arg, opened, size_arg
from tiered_kv.cli.render import EXIT_OK, EXIT_PROBLEM
from tiered_kv.errors import ConfigError
from tiered_kv.keys import CANONICAL_LAYOUT


def add_parsers(sub) -> None:
    p = sub.add_parser("inspect", help="per tier and namespace: blocks, tokens, bytes, ratio, model, ages")
    add_store_args(p)
    p.set_defaults(handler=cmd_inspect)

    p = sub.add_parser("ls", help="list stored blocks (filters, sorting, paging)")
    add_store_args(p)
    p.add_argument("--namespace", metavar="NS", help="digest prefix, model id or namespace JSON file")
    p.add_argument("--older-than", type=duration_arg, metavar="AGE", help="last access (or creation) at least AGE ago")
    p.add_argument("--newer-than", type=duration_arg, metavar="AGE", help="last access (or creation) less than AGE ago")
    p.add_argument("--min-size", type=size_arg, metavar="SIZE")
    p.add_argument("--max-size", type=size_arg, metavar="SIZE")
    p.add_argument("--all", action="store_true", help="namespace records and foreign entries too")
    p.add_argument("--sort", choices=("key", "size", "created", "access"), default="key")
    p.add_argument("--limit", type=int, default=100, help="rows per page; 0: all (default: %(default)s)")
    p.add_argument("--offset", type=int, default=0, help="rows to skip (paging)")
    p.set_defaults(handler=cmd_ls)

    p = sub.add_parser("show", help="one entry: header fields and per-layer K/V statistics")
    add_store_args(p)
    p.add_argument("key", metavar="KEY", help="key in hex (whole, a unique prefix of 8+, or the 32-hex block key)")
    p.add_argument("--namespace", metavar="NS", help="namespace of a 32-hex block key")
    p.add_argument("--no-stats", action="store_true", help="skip decoding the payload for statistics")
    p.set_defaults(handler=cmd_show)

    p = sub.add_parser("explain", help="for a prompt: which blocks each tier holds, the first miss, and "
                       "what the restore policy would load")
    add_store_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", metavar="FILE", help="token ids: a JSON list or whitespace/comma separated")
    src.add_argument("--token-ids", metavar="IDS", help="token ids, e.g. 1,2,3")
    p.add_argument("--namespace", metavar="NS", help="digest prefix, model id or namespace JSON file "
                   "(default: the only namespace stored)")
    p.add_argument("--lora", help="LoRA id folded into the keys")
    add_restore_args(p)
    p.set_defaults(handler=cmd_explain)


def add_restore_args(p) -> None:
    """The restore settings explain decides with (default: --config's, else the defaults)."""
    g = p.add_argument_group("restore policy (default: as --config sets it)")
    g.add_argument("--restore-policy", choices=("cost", "always"), help="cost: the prefix that minimizes "
                   "predicted TTFT; always: every stored block")
    g.add_argument("--min-samples", type=int, metavar="N", help="observations an estimate needs (the floor)")
    g.add_argument("--layerwise-loads", action=argparse.BooleanOptionalAction, default=None,
                   help="sync loads overlap the prefill layer group by layer group (default: as "
                   "configured; \"auto\" streams on accelerators only)")
    g.add_argument("--engine-device", choices=("cuda", "cpu"), help="where the engine's KV cache lives "
                   "(settles layerwise_loads = \"auto\"; default cuda)")
    g.add_argument("--layer-groups", type=int, metavar="N", help="layer groups a layer-wise load streams")
    g.add_argument("--load-async", action="store_true", default=None, help="loads complete between steps "
                   "(no overlap with the prefill)")


def cmd_inspect(args: argparse.Namespace) -> int:
    from tiered_kv.admin.inventory import inspect_tier

    with opened(args) as tiers:
        reports = [inspect_tier(t) for t in tiers]
    if args.json:
        render.emit_json({"tiers": reports})
        return EXIT_OK
    out = render.console()
    for r in reports:
        cap = f" of {render.size(r['capacity_bytes'])} ({r['capacity_used']:.1%})" if r["capacity_bytes"] else ""
        others = f", {r['other_store_entries']} of stores under longer prefixes" if r["other_store_entries"] else ""
        out.print(f"[bold]{r['tier']}[/bold] {r['url']} ({r['medium']}): {r['blocks']} blocks, "
                  f"{r['namespace_records']} namespace records, {r['foreign_entries']} foreign entries{others}; "
                  f"{render.size(r['used_bytes'])} used{cap}")
        rows = []
        for digest, n in r["namespaces"].items():
            ages = " ".join(f"{k}:{v}" for k, v in (n["last_access_age"] or {}).items() if v)
            model = n["model_id"] or "?"
            if n.get("layout") not in (None, CANONICAL_LAYOUT):  # an engine's own page layout (SGLang's)
                model += f" ({':'.join(n['layout'].split(':')[:3])})"
            if n.get("groups"):  # MLA, sliding-window, hybrid: the KV groups a block carries
                model += " (" + ", ".join(_group_label(g) for g in n["groups"]) + ")"
            rows.append([digest[:12], model, n.get("dtype"), n.get("block_shape"), n["blocks"],
                         n["tokens"], render.size(n["raw_bytes"]), render.size(n["stored_bytes"]),
                         n["compression_ratio"], n["oldest"], n["newest"], ages or None])
        out.print(render.table(None, ["namespace", "model", "dtype", "block shape", "blocks", "tokens", "raw",
                                      "stored", "ratio", "oldest", "newest", "last access"], rows,
                               right=("blocks", "tokens", "raw", "stored", "ratio")))
        if _has_tenants(r["tenants"]):
            out.print(_tenant_table(r["tenants"]))
    return EXIT_OK


def _group_label(g: dict) -> str:
    label = g["kind"] + (f"/{g['window']}" if g.get("window") else "")
    return f"{label} x{g['layers']}"


def _has_tenants(tenants: dict[str, dict] | None) -> bool:
    """Whether a tier's usage per tenant says more than its total: a labelled tenant, or a quota."""
    return bool(tenants) and (set(tenants) != {NO_TENANT} or any(t["quota_bytes"] for t in tenants.values()))


def _tenant_table(tenants: dict[str, dict]):
    rows = [[label, t["entries"], render.size(t["stored_bytes"]), render.size(t["quota_bytes"]),
             None if t["quota_used"] is None else f"{t['quota_used']:.1%}"] for label, t in tenants.items()]
    return render.table("usage per tenant", ["tenant", "entries", "stored", "quota", "of quota"], rows,
                        right=("entries", "stored", "quota", "of quota"))


def cmd_ls(args: argparse.Namespace) -> int:
    from tiered_kv.admin.catalog import namespace_filter
    from tiered_kv.admin.inventory import Filter, list_entries

    if args.limit < 0 or args.offset < 0:
        raise ConfigError("--limit and --offset must not be negative")
    now = time.time()
    pages = []
    with opened(args) as tiers:
        for tier in tiers:
            flt = Filter(namespace_filter(tier, args.namespace), args.older_than, args.newer_than,
                         args.min_size, args.max_size, args.all)
            total, rows = list_entries(tier, flt, sort=args.sort, offset=args.offset,
                                       limit=args.limit or None, now=now)
            pages.append({"tier": tier.name, "url": tier.shown_url, "total": total,
                          "offset": args.offset, "rows": rows})
    if args.json:
        render.emit_json({"tiers": pages})
        return EXIT_OK
    out = render.console()
    for page in pages:
        rows = [[r["key"], r["kind"] if r["kind"] != "block" else r["model_id"], render.size(r["size"]),
                 r["created"], render.age(r["age_s"]), r["hits"]] for r in page["rows"]]
        shown = f"{page['offset'] + 1}-{page['offset'] + len(rows)}" if rows else "none"
        out.print(render.table(f"{page['tier']} {page['url']}: {shown} of {page['total']}",
                               ["key", "model", "size", "created", "last access", "hits"], rows,
                               right=("size", "hits")))
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    from tiered_kv.admin.inventory import find_key, show_entry

    with opened(args) as tiers:
        tier, key = find_key(tiers, args.key, args.namespace)
        report = show_entry(tier, key, stats=not args.no_stats)
    if args.json:
        render.emit_json(report)
    elif report.get("valid", True) is False:  # a block that fails its checks: one line, what lied
        render.console().print(f"{report['tier']} {report['key']}: {report['reason']}: {report['error']}",
                               soft_wrap=True, markup=False)
    else:
        out = render.console()
        fields = {k: v for k, v in report.items() if k not in ("header", "layers", "groups")}
        out.print(render.table(None, ["field", "value"], list(fields.items())))
        if report.get("groups"):
            rows = [[i, _group_label(g), g["shape"], g["dtype"], g["entry"], f"{g['bytes'][0]}-{g['bytes'][1]}"]
                    for i, g in enumerate(report["groups"])]
            out.print(render.table("KV groups (a block entry holds the token groups, a state entry the state "
                                   "groups)", ["group", "kind", "shape", "dtype", "entry", "bytes"], rows))
        if "header" in report:
            out.print(render.table("header", ["field", "value"], list(report["header"].items())))
        if report.get("layers"):
            rows = [[r["layer"], r["part"], *(_num(r[k]) for k in ("min", "max", "mean", "std")), r["nan"], r["inf"]]
                    for r in report["layers"]]
            out.print(render.table("per-layer statistics", ["layer", "K/V", "min", "max", "mean", "std", "NaN", "Inf"],
                                   rows, right=("min", "max", "mean", "std", "NaN", "Inf")))
    return EXIT_OK if report.get("valid", True) else EXIT_PROBLEM


def _num(x) -> str | None:
    return None if x is None else f"{x:.4g}"


def cmd_explain(args: argparse.Namespace) -> int:
    from tiered_kv.admin.explain import BlockKeys, RestoreOptions, explain, parse_token_ids, read_tokens
    from tiered_kv.config import TieredKVConfig

    tokens = read_tokens(args.tokens) if args.tokens else parse_token_ids(args.token_ids)
    config = TieredKVConfig.from_toml(args.config) if args.config else None
    options = RestoreOptions.of(config, policy=args.restore_policy, min_samples=args.min_samples,
                                layerwise=args.layerwise_loads, layer_groups=args.layer_groups,
                                load_async=args.load_async, device=args.engine_device)
    with opened(args) as tiers:
        # blocks opened as the config's engine opens them: with its secret, or knowing it has none
        report = explain(tiers, tokens, args.namespace, args.lora, options,
                         BlockKeys.of(config) if config is not None else None)
    if args.json:
        render.emit_json(report)
        return EXIT_OK
    out = render.console()
    rows = []
    for run in _runs(report["blocks"]):
        first, last = run[0], run[-1]
        where = first["tier"] or "; ".join(f"{t}: {s}" for t, s in first["status"].items())
        rows.append([f"{first['index']}-{last['index']}" if len(run) > 1 else first["index"],
                     f"{first['tokens'][0]}-{last['tokens'][1]}", len(run), where])
    out.print(f"{report['model_id']} (namespace {report['namespace'][:12]}): {report['tokens']} tokens, "
              f"{report['full_blocks']} full blocks of {report['block_size']}; tiers: {', '.join(report['tiers'])}")
    out.print(render.table(None, ["blocks", "tokens", "n", "where"], rows, right=("n",)))
    miss = report["first_miss"]
    out.print(f"reusable: [bold]{report['matched_tokens']}[/bold] tokens ({report['matched_blocks']} blocks: "
              + (", ".join(f"{t} {n}" for t, n in report["tier_blocks"].items()) or "none") + ")")
    if miss:
        out.print(f"first miss: block {miss['index']} (tokens {miss['tokens'][0]}-{miss['tokens'][1]}): "
                  f"[bold]{miss['reason']}[/bold] — {escape(miss['detail'])}", soft_wrap=True)
    out.print(_restore_line(report["restore"]), soft_wrap=True)
    return EXIT_OK


def _restore_line(r: dict) -> str:
    """What the restore policy would load, the predictions it weighed and why."""
    line = (f"restore ({r['policy']}): would load [bold]{r['load_blocks']}[/bold] of {r['stored_blocks']} "
            f"stored blocks ({r['load_tokens']} tokens): [bold]{r['reason']}[/bold]")
    if r["ttft_s"] is not None:
        mode = "layer-wise, beside the prefill" if r["overlap"] else "whole blocks, before the prefill"
        line += (f" — predicted TTFT {_s(r['ttft_s'])} (restore {_s(r['restore_s'])}, {mode} on "
                 f"{r['engine_device']}; prefill {_s(r['recompute_s'])}); loading all {_s(r['load_all_s'])}, recomputing all "
                 f"{_s(r['recompute_all_s'])}")
    if r["skipped"]:
        line += "; not loaded: " + ", ".join(f"{t} {n}" for t, n in r["skipped"].items())
    return line + (f" ({escape(r['detail'])})" if r["detail"] else "")


def _s(seconds: float) -> str:
    return f"{seconds:.3f}s"


def _runs(blocks: list[dict]) -> list[list[dict]]:
    runs: list[list[dict]] = []
    for b in blocks:
        if runs and runs[-1][-1]["tier"] == b["tier"] and runs[-1][-1]["status"] == b["status"]:
            runs[-1].append(b)
        else:
            runs.append([b])
    return runs
