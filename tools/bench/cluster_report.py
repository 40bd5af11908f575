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
commands on one thread, so this is what one node saturates at, wherever the client runs).

Encryption at rest (``--encrypt``, on by default): ``ours_sealed`` phase records are the ``ours``
phases with the blocks sealed as the store seals them with ``encryption_secret`` set (their
``stored_bytes`` the sealed bytes), reported beside ``ours`` (``ratio_sealed_over_ours``, paired
per repeat, in payload GB/s); sealing and opening themselves are timed on the client
(``tools/bench/cluster_crypto.py``), one record per kind, threads, op and repeat::

    {"kind", "threads", "op": "encode"|"encode+seal"|"seal"|"decode"|"open+decode", "rep",
     "seconds", "cpu_s", "blocks", "payload_bytes"}

summed up by :func:`crypto_figures`: GB/s and CPU s per GB of each op, and per path (``write``:
encode+seal beside encode; ``read``: open+decode beside decode) the sealed / plain GB/s and the
seconds per GB encryption adds."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Iterable

GB = 1e9
MODEL_KIND = "llama8b-2MiB"  # the kind whose figures feed the capacity model
PLAIN_PATHS = ("ours", "raw")
SEALED = "ours_sealed"  # the ours phases with sealed blocks
PAIRS = {"write": ("encode", "encode+seal"), "read": ("decode", "open+decode")}  # plain, sealed


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


def paired_ratio(recs: list[dict], op: str, num: str = "ours", den: str = "raw") -> float | None:
    """Median over repeats of ``num`` / ``den`` payload GB/s of ``op`` (both ran in the same
    repeat; ours and raw move the same stored bytes, a sealed block more)."""
    by_rep: dict[int, dict[str, float]] = defaultdict(dict)
    for r in recs:
        if r["op"] == op:
            by_rep[r["rep"]][r["path"]] = r["payload_bytes"] / r["seconds"]
    return _r(_median(v[num] / v[den] for v in by_rep.values() if num in v and den in v))


def spread(recs: list[dict]) -> dict:
    """Stored bytes per master (from the slot of each key), their max / mean, and what each
    master's ``used_memory`` grew by per stored byte (Redis' overhead)."""
    put = [r for r in recs if r["op"] == "put" and r["path"] in PLAIN_PATHS]
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


def build(records: list[dict], codecs: dict, meta: dict, crypto_records: list[dict] | None = None,
          encryption: dict | None = None) -> dict:
    """The whole report: ``results[kind][masters]`` with ``ours`` / ``raw`` (and ``ours_sealed``)
    figures per op, ``ratio_ours_over_raw`` (and ``ratio_sealed_over_ours``) per op and
    ``spread``; ``codec`` per kind; ``model_inputs``; with ``encryption`` (what was sealed, and
    how: ``stored`` per kind, ...) that dict and ``client``, :func:`crypto_figures` of
    ``crypto_records``."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["kind"], r["masters"])].append(r)
    results: dict = defaultdict(dict)
    for (kind, masters), recs in sorted(groups.items()):
        entry: dict = {}
        for path in (*PLAIN_PATHS, SEALED):
            for op in ("put", "get"):
                sel = [r for r in recs if r["path"] == path and r["op"] == op]
                if sel:
                    entry.setdefault(path, {})[op] = phase_figures(sel)
        entry["ratio_ours_over_raw"] = {op: paired_ratio(recs, op) for op in ("put", "get")}
        if SEALED in entry:
            entry["ratio_sealed_over_ours"] = {op: paired_ratio(recs, op, SEALED, "ours") for op in ("put", "get")}
        entry["spread"] = spread(recs)
        results[kind][str(masters)] = entry
    report = {"meta": meta, "codec": codecs, "results": dict(results)}
    report["model_inputs"] = model_inputs(report)
    if encryption is not None:
        report["encryption"] = {**encryption, "client": crypto_figures(crypto_records or [])}
    return report


def crypto_figures(records: list[dict]) -> dict:
    """``[kind][threads]``: per op the median payload GB/s, CPU s per payload GB and seconds;
    per path (``write``, ``read``) ``sealed_over_plain`` (sealed / plain GB/s, paired per
    repeat: 1.0 is free, 0.5 halves the throughput), ``cpu_sealed_over_plain`` (CPU per GB,
    sealed / plain) and ``added_s_per_gb`` (wall seconds encryption adds per payload GB)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["kind"], r["threads"])].append(r)
    out: dict = defaultdict(dict)
    for (kind, threads), recs in sorted(groups.items()):
        entry: dict = {}
        by_op: dict[str, list[dict]] = defaultdict(list)
        for r in recs:
            by_op[r["op"]].append(r)
        for op, sel in by_op.items():
            entry[op] = {"gbps": _r(_median(r["payload_bytes"] / r["seconds"] / GB for r in sel)),
                         "cpu_s_per_gb": _r(_median(r["cpu_s"] / (r["payload_bytes"] / GB) for r in sel), 4),
                         "seconds": _r(_median(r["seconds"] for r in sel), 4), "repeats": len(sel)}
        for path, (plain, sealed) in PAIRS.items():
            per_rep: dict[int, dict[str, dict]] = defaultdict(dict)
            for r in recs:
                if r["op"] in (plain, sealed):
                    per_rep[r["rep"]][r["op"]] = r
            both = [v for v in per_rep.values() if plain in v and sealed in v]
            if not both:
                continue
            entry[path] = {
                "plain": plain, "sealed": sealed,
                "sealed_over_plain": _r(_median(v[plain]["seconds"] / v[sealed]["seconds"] for v in both)),
                "cpu_sealed_over_plain": _r(_median(v[sealed]["cpu_s"] / v[plain]["cpu_s"] for v in both
                                                    if v[plain]["cpu_s"] > 0)),
                "added_s_per_gb": _r(_median((v[sealed]["seconds"] - v[plain]["seconds"])
                                             / (v[plain]["payload_bytes"] / GB) for v in both), 4)}
        out[kind][str(threads)] = entry
    return dict(out)


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
    if "encryption" in report:
        lines += ["", *encryption_table(report)]
    lines += ["", "model inputs: " + json.dumps(report["model_inputs"])]
    return "\n".join(lines)


def encryption_table(report: dict) -> list[str]:
    """The encryption section: client-side seal / open GB/s beside plain encode / decode, the
    stored bytes sealing adds, and the sealed put / get through each cluster beside ours."""
    enc = report["encryption"]
    lines = [f"encryption at rest ({enc.get('cipher', 'AES-GCM')}): client side, the remote tier's own "
             "put_blobs / read_into over memory (no network), payload GB/s"]
    head = (f"{'kind':<14}{'threads':>8} {'op':<13}{'GB/s':>8}{'cpu s/GB':>10}"
            f"{'   sealed/plain (GB/s)':>22}{'added s/GB':>12}")
    lines += [head, "-" * len(head)]
    for kind, by_threads in enc.get("client", {}).items():
        for threads, e in sorted(by_threads.items(), key=lambda kv: int(kv[0])):
            for path, pair in PAIRS.items():
                cost = e.get(path, {})
                for op in pair:
                    f = e.get(op, {})
                    sealed = op == pair[1]
                    lines.append(f"{kind:<14}{threads:>8} {op:<13}{_f(f.get('gbps')):>8}"
                                 f"{_f(f.get('cpu_s_per_gb')):>10}"
                                 f"{(_f(cost.get('sealed_over_plain')) if sealed else ''):>22}"
                                 f"{(_f(cost.get('added_s_per_gb')) if sealed else ''):>12}")
            if "seal" in e:
                lines.append(f"{kind:<14}{threads:>8} {'seal alone':<13}{_f(e['seal'].get('gbps')):>8}"
                             f"{_f(e['seal'].get('cpu_s_per_gb')):>10}")
    for kind, st in enc.get("stored", {}).items():
        lines.append(f"  stored, {kind}: {st['plain_stored_bytes_per_block']:,.0f} -> "
                     f"{st['sealed_stored_bytes_per_block']:,.0f} bytes per block "
                     f"(+{st['overhead_bytes_per_block']:,.0f}, {st['overhead_pct']:.3f}%; {st['frames']} frame(s), "
                     f"{st['expected_overhead_bytes']} expected)")
    rows = [(kind, masters, e) for kind, runs in report["results"].items()
            for masters, e in sorted(runs.items(), key=lambda kv: int(kv[0])) if SEALED in e]
    if rows:
        head = (f"{'kind':<14}{'masters':>8} {'op':<4}{'sealed GB/s':>12}{'ours GB/s':>10}"
                f"{'sealed/ours':>12}{'wire sealed':>12}{'client s/GB':>12}")
        lines += ["", "ours, sealed: the same put / get through the cluster with sealed blocks (sealed "
                  "before the timing, opened after it: their CPU is the client side above)", head, "-" * len(head)]
        for kind, masters, e in rows:
            for op in ("put", "get"):
                s, o = e[SEALED].get(op, {}), e.get("ours", {}).get(op, {})
                lines.append(f"{kind:<14}{masters:>8} {op:<4}{_f(s.get('payload_gbps')):>12}"
                             f"{_f(o.get('payload_gbps')):>10}{_f(e['ratio_sealed_over_ours'][op]):>12}"
                             f"{_f(s.get('wire_gbps')):>12}{_f(s.get('client_cpu_s_per_gb')):>12}")
    return lines
