"""Commands that check or change a store, and the metrics summary: ``verify``, ``evict``,
``copy``, ``stats``."""

from __future__ import annotations

import argparse

from tiered_kv.cli import render
from tiered_kv.cli.options import add_common, add_store_args, duration_arg, opened, opened_url, size_arg
from tiered_kv.cli.render import EXIT_OK, EXIT_PROBLEM


def add_parsers(sub) -> None:
    p = sub.add_parser("verify", help="decode every block; report corrupt, mismatched, orphaned entries "
                       "and bookkeeping drift (exit 1 when anything is wrong)")
    add_store_args(p)
    p.add_argument("--fix", action="store_true", help="remove bad entries and repair bookkeeping")
    p.set_defaults(handler=cmd_verify)

    p = sub.add_parser("evict", help="remove blocks: least recently used down to a size, by age, or a namespace")
    add_store_args(p)
    p.add_argument("--to", type=size_arg, metavar="SIZE", help="until the tier's stored values total at most SIZE")
    p.add_argument("--older-than", type=duration_arg, metavar="AGE", help="last access (or creation) at least AGE ago")
    p.add_argument("--namespace", metavar="NS", help="only this namespace (alone: all of it, record included)")
    p.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    p.set_defaults(handler=cmd_evict)

    p = sub.add_parser("copy", help="copy blocks and namespace records from SRC to DST (validated on the way)")
    p.add_argument("src", metavar="SRC", help="source store URL or directory")
    p.add_argument("dst", metavar="DST", help="destination store URL (created when it is a new lmdb:// or file:// path)")
    p.add_argument("--namespace", metavar="NS", help="only this namespace")
    p.add_argument("--overwrite", action="store_true", help="also copy blocks DST already holds (never a plain block over an encrypted one, or the reverse)")
    p.add_argument("--no-verify", action="store_true", help="check headers only, do not decode bodies")
    add_common(p)
    p.set_defaults(handler=cmd_copy)

    p = sub.add_parser("stats", help="summarise a tiered-kv Prometheus endpoint (or a saved scrape)")
    p.add_argument("target", metavar="URL", help="http://host:port[/metrics], host:port, or a file")
    add_common(p)
    p.set_defaults(handler=cmd_stats)


def cmd_verify(args: argparse.Namespace) -> int:
    from tiered_kv.admin.verify import verify_tier

    reports = []
    with opened(args) as tiers:
        for tier in tiers:
            with render.progress(f"verify {tier.name}", not args.json) as advance:
                reports.append(verify_tier(tier, fix=args.fix, progress=advance))
    ok = all(r["ok"] for r in reports)
    if args.json:
        render.emit_json({"ok": ok, "tiers": reports})
    else:
        out = render.console()
        for r in reports:
            problems = ", ".join(f"{n} {k}" for k, n in r["problems"].items() if n) or "no problems"
            out.print(f"[bold]{r['tier']}[/bold] {r['url']}: {r['checked']} entries checked, "
                      f"{r['valid_blocks']} valid blocks; {problems}")
            for f in r["findings"]:  # one line each (a table folds long keys and details)
                out.print(f"{f['kind']} {f['key'] or '-'}: {f['detail']}{' (fixed)' if f['fixed'] else ''}",
                          soft_wrap=True, markup=False)
            for line in r["actions"]:
                out.print(f"fix: {line}")
            for line in r["notes"]:
                out.print(f"note: {line}")
    return EXIT_OK if ok else EXIT_PROBLEM


def cmd_evict(args: argparse.Namespace) -> int:
    from tiered_kv.admin.catalog import namespace_filter
    from tiered_kv.admin.evict_copy import evict

    reports = []
    with opened(args) as tiers:
        for tier in tiers:
            digest = namespace_filter(tier, args.namespace)
            with render.progress(f"evict {tier.name}", not args.json) as advance:
                reports.append(evict(tier, to=args.to, older_than=args.older_than, namespace=digest,
                                     dry_run=args.dry_run, progress=advance))
    if args.json:
        render.emit_json({"tiers": reports})
        return EXIT_OK
    out = render.console()
    for r in reports:
        verb = "would evict" if r["dry_run"] else "evicted"
        out.print(f"[bold]{r['tier']}[/bold] {r['url']}: {verb} {r['evicted_blocks']} blocks "
                  f"({render.size(r['freed_bytes'])}, oldest {r['order']} first); stored "
                  f"{render.size(r['stored_bytes_before'])} -> {render.size(r['stored_bytes_after'])}")
    return EXIT_OK


def cmd_copy(args: argparse.Namespace) -> int:
    from tiered_kv.admin.catalog import namespace_filter
    from tiered_kv.admin.evict_copy import copy

    with opened_url(args.src, args, name="source") as src, \
            opened_url(args.dst, args, create=True, name="destination", room=lambda: src.backend.stats().used_bytes) as dst:
        digest = namespace_filter(src, args.namespace)
        with render.progress("copy", not args.json) as advance:
            report = copy(src, dst, namespace=digest, overwrite=args.overwrite,
                          verify=not args.no_verify, progress=advance)
    bad = bool(report["corrupt_skipped"] or report["unreadable_skipped"] or report["rejected"])
    if args.json:
        render.emit_json(report)
    else:
        out = render.console()
        out.print(f"copied {report['copied']} of {report['blocks']} blocks "
                  f"({render.size(report['copied_bytes'])}) and {report['namespace_records']} namespace records "
                  f"from {report['source']} to {report['destination']}; {report['already_present']} already there")
        for key, why in report["corrupt_details"].items():  # one line each: which block, what is wrong
            out.print(f"skipped corrupt block {key}: {why}", soft_wrap=True, markup=False)
        for key, why in report["unreadable_details"].items():
            out.print(f"skipped unreadable block {key}: {why}", soft_wrap=True, markup=False)
        if report["rejected"]:
            out.print(f"the destination refused {report['rejected']} blocks (full?)")
        if report["evicted_at_destination"]:
            out.print(f"the destination evicted {report['evicted_at_destination']} entries to make room")
        if report["changed_at_source"]:
            out.print(f"{len(report['changed_at_source'])} blocks changed or went at the source while they were "
                      "copied (withdrawn by an engine, say): taken back from the destination")
        if report["encrypted_kept"]:
            out.print(f"kept {report['encrypted_kept']} encrypted blocks of the destination that the source holds "
                      "unencrypted (its engines encrypt: they would not use them)")
        if report["unencrypted_kept"]:
            out.print(f"kept {report['unencrypted_kept']} unencrypted blocks of the destination that the source "
                      "holds encrypted (engines without the secret could not open them)")
        if report["namespace_records_kept"]:
            out.print(f"kept the destination's own namespace records ({report['namespace_records_kept']})")
        for record, why in report["broken_namespace_records"].items():
            out.print(f"skipped source namespace record {record}: {why}", soft_wrap=True, markup=False)
    return EXIT_PROBLEM if bad else EXIT_OK


def cmd_stats(args: argparse.Namespace) -> int:
    from storage_backends.redaction import redact_url
    from tiered_kv.admin.stats import fetch, summarize

    report = summarize(fetch(args.target, args.timeout))
    if args.json:
        render.emit_json(report)
        return EXIT_OK
    out = render.console()
    rows = []
    for name, t in report["tiers"].items():
        misses = ", ".join(f"{r}:{n}" for r, n in t["misses"].items()) or None
        rate = None if t["hit_rate"] is None else f"{t['hit_rate']:.1%}"
        rows.append([name, t["hits"], misses, rate, t["in"]["blocks"], render.size(t["in"]["bytes"]),
                     t["in"]["mb_per_s"], t["out"]["blocks"], render.size(t["out"]["bytes"]), t["out"]["mb_per_s"],
                     t["evictions"], t.get("entries"), render.size(t.get("used_bytes"))])
    out.print(render.table(f"tiered-kv metrics: {redact_url(args.target)}",
                           ["tier", "hits", "misses", "hit rate", "blocks in", "bytes in", "MB/s in",
                            "blocks out", "bytes out", "MB/s out", "evictions", "entries", "used"], rows,
                           right=("hits", "blocks in", "bytes in", "MB/s in", "blocks out", "bytes out",
                                  "MB/s out", "evictions", "entries", "used")))
    events = ", ".join(f"{k}: {v}" for k, v in report["events"].items()) or "none"
    queued = ", ".join(f"{k}: {render.size(v)}" for k, v in report["queued_bytes"].items()) or "none"
    out.print(f"events: {events}; queued: {queued}", markup=False)  # (labels as scraped: "[/x]" is no markup)
    if report["skipped_samples"]:
        out.print(f"skipped {report['skipped_samples']} samples (a label missing or a value not a number)")
    return EXIT_OK
