"""bench_cluster's report: medians over repeats of every phase, ours / raw ratios (paired within
each repeat, where both ran close together), the per-node spread of stored bytes, each master's
command-thread CPU per GB, and ``model_inputs``: the figures ``tools/scale_model.py`` reads.

A phase record (one per kind, masters, path, op and repeat)::

    {"kind", "masters", "path": "ours"|"raw", "op": "put"|"get", "rep", "seconds",
     "client_cpu_s", "server_cpu_s": [per master], "blocks", "payload_bytes", "stored_bytes",
     "node_bytes": [stored bytes per master], "memory": [per master, puts only]}

GB/s are 1e9 bytes a second: ``payload`` counts the blocks' uncompressed bytes, ``wire`` the
stored (encoded) bytes that crossed the network. A node's ``ceiling`` is the stored GB/s its
command thread would carry with a core to itself: its bytes over its CPU seconds (Redis runs
commands on one thread, so this is what one node saturates at, wherever the client runs)."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Iterable

GB = 1e9
MODEL_KIND = "llama8b-2MiB"  # the kind whose figures feed the capacity model


def _median(xs: Iterable[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def phase_figures(recs: list[dict]) -> dict:
    """Medians over the repeats of one (kind, masters, path, op)."""
    first = recs[0]
    payload = _median(r["payload_bytes"] / r["seconds"] / GB for r in recs)
    wire = _median(r["stored_bytes"] / r["seconds"] / GB for r in recs)
    nodes = len(first["node_bytes"])
    node_cpu_per_gb = [_median(r["server_cpu_s"][i] / (r["node_bytes"][i] / GB)
                               for r in recs if r["server_cpu_s"][i] is not None and r["node_bytes"][i])
                       for i in range(nodes)]
    ceilings = [None if c is None or c <= 0 else 1 / c for c in node_cpu_per_gb]
    return {"repeats": len(recs), "payload_gbps": _r(payload), "wire_gbps": _r(wire),
            "seconds": _r(_median(r["seconds"] for r in recs), 4),
            "client_cpu_s_per_gb": _r(_median(r["client_cpu_s"] / (r["stored_bytes"] / GB) for r in recs)),
            "node_cpu_s_per_gb": [_r(c) for c in node_cpu_per_gb],
            "node_ceiling_gbps": [_r(c) for c in ceilings],
            "server_busy": _r(_median(sum(c or 0 for c in r["server_cpu_s"]) / r["seconds"] for r in recs))}


def paired_ratio(recs: list[dict], op: str) -> float | None:
    """Median over repeats of ours / raw GB/s of ``op`` (both ran in the same repeat)."""
    by_rep: dict[int, dict[str, float]] = defaultdict(dict)
    for r in recs:
        if r["op"] == op:
            by_rep[r["rep"]][r["path"]] = r["stored_bytes"] / r["seconds"]
    return _r(_median(v["ours"] / v["raw"] for v in by_rep.values() if "ours" in v and "raw" in v))


def spread(recs: list[dict]) -> dict:
    """Stored bytes per master (from the slot of each key), their max / mean, and what each
    master's ``used_memory`` grew by per stored byte (Redis' overhead)."""
    put = [r for r in recs if r["op"] == "put"]
    node_bytes = put[0]["node_bytes"]
    mean = sum(node_bytes) / len(node_bytes)
    grew = [m for r in put for m in r.get("memory", [])]
    per_node_mem = defaultdict(list)
    for m in grew:
        per_node_mem[m["port"]].append(m["used_memory_delta"])
    used = sum(_median(v) or 0 for v in per_node_mem.values())
    stored = put[0]["stored_bytes"]
    return {"node_bytes": node_bytes, "node_share": [_r(b / sum(node_bytes), 4) for b in node_bytes],
            "max_over_mean": _r(max(node_bytes) / mean if mean else None),
            "node_keys": [m["keys"] for m in put[0].get("memory", [])],
            "memory_overhead": _r(used / stored if stored and used > 0 else None)}


def build(records: list[dict], codecs: dict, meta: dict) -> dict:
    """The whole report: ``results[kind][masters]`` with ``ours`` / ``raw`` figures per op,
    ``ratio_ours_over_raw`` per op and ``spread``; ``codec`` per kind; ``model_inputs``."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["kind"], r["masters"])].append(r)
    results: dict = defaultdict(dict)
    for (kind, masters), recs in sorted(groups.items()):
        entry: dict = {}
        for path in ("ours", "raw"):
            for op in ("put", "get"):
                sel = [r for r in recs if r["path"] == path and r["op"] == op]
                if sel:
                    entry.setdefault(path, {})[op] = phase_figures(sel)
        entry["ratio_ours_over_raw"] = {op: paired_ratio(recs, op) for op in ("put", "get")}
        entry["spread"] = spread(recs)
        results[kind][str(masters)] = entry
    report = {"meta": meta, "codec": codecs, "results": dict(results)}
    report["model_inputs"] = model_inputs(report)
    return report


def model_inputs(report: dict, kind: str = MODEL_KIND) -> dict:
    """What the capacity model needs, from the smallest cluster of ``kind`` measured: per node
    put / get GB/s of stored bytes (the command-thread ceiling, and the wall figure this run saw),
    the codec ratio the store wrote with, the zstd+shuffle ratio, Redis' memory overhead."""
    runs = report["results"].get(kind) or next(iter(report["results"].values()), {})
    if not runs:
        return {}
    masters = min(runs, key=int)
    ours = runs[masters].get("ours", {})
    codec = report["codec"].get(kind, {})

    def ceiling(op: str) -> float | None:
        return _median(ours.get(op, {}).get("node_ceiling_gbps") or [])

    def wall(op: str) -> float | None:
        w = ours.get(op, {}).get("wire_gbps")
        return None if w is None else w / int(masters)

    return {"from": f"{kind}, {masters} master(s), ours",
            "node_put_gbps": _r(ceiling("put")), "node_get_gbps": _r(ceiling("get")),
            "node_put_gbps_wall": _r(wall("put")), "node_get_gbps_wall": _r(wall("get")),
            "codec": codec.get("codec"), "codec_ratio": codec.get("ratio"),
            "compressed_ratio": codec.get("zstd_shuffle_ratio"),
            "memory_overhead": runs[masters].get("spread", {}).get("memory_overhead")}


def _f(x) -> str:
    return "-" if x is None else (f"{x:.2f}" if isinstance(x, float) else str(x))


def table(report: dict) -> str:
    lines = [f"bench_cluster  ({report['meta'].get('note', '')})"]
    for kind, c in report["codec"].items():
        lines.append(f"  {kind}: codec {c['codec']} (ratio {_f(c['ratio'])}; zstd+shuffle would give "
                     f"{_f(c.get('zstd_shuffle_ratio'))}), {c['segments']} frame(s) per block")
    head = (f"{'kind':<14}{'masters':>8} {'op':<4}{'ours GB/s':>10}{'raw GB/s':>10}{'ours/raw':>9}"
            f"{'wire ours':>10}{'node ceiling GB/s (ours)':>26}{'client s/GB':>12}")
    lines += ["", head, "-" * len(head)]
    for kind, runs in report["results"].items():
        for masters, e in sorted(runs.items(), key=lambda kv: int(kv[0])):
            for op in ("put", "get"):
                o, r = e.get("ours", {}).get(op, {}), e.get("raw", {}).get(op, {})
                ceil = ",".join(_f(x) for x in o.get("node_ceiling_gbps") or []) or "-"
                lines.append(f"{kind:<14}{masters:>8} {op:<4}{_f(o.get('payload_gbps')):>10}"
                             f"{_f(r.get('payload_gbps')):>10}{_f(e['ratio_ours_over_raw'][op]):>9}"
                             f"{_f(o.get('wire_gbps')):>10}{ceil:>26}{_f(o.get('client_cpu_s_per_gb')):>12}")
            s = e["spread"]
            lines.append(f"{'':<14}{'':>8} spread: bytes share {s['node_share']}, max/mean "
                         f"{_f(s['max_over_mean'])}, keys {s['node_keys']}, used_memory / stored "
                         f"{_f(s['memory_overhead'])}")
    lines += ["", "model inputs: " + json.dumps(report["model_inputs"])]
    return "\n".join(lines)
