#!/usr/bin/env python
"""The capacity model of docs/scale.md: many engine replicas sharing one Redis Cluster as their
remote KV tier. Prints the doc's tables (markdown, or ``--json``) from measured inputs:

    python tools/scale_model.py [--inputs BENCH.json] [--hit-rate H] [--prompt-tokens P] ...

``--inputs`` takes what ``tools/bench_cluster.py --json`` printed (its ``model_inputs``) or a
bare object with those fields; without it the defaults below are used (docs/scale.md says where
they come from). Every other assumption is a flag. Formulas (all bytes are stored bytes, i.e.
payload / codec ratio; GB = 1e9 bytes):

    bytes/token     = 2 (K, V) x layers x kv_heads x head_dim x dtype bytes
    blocks/prompt   = floor(prompt tokens / block tokens)            (only full blocks are stored)
    write GB/s      = replicas x req/s x blocks/prompt x block bytes x (1 - hit) x write fraction / ratio
    read GB/s       = replicas x req/s x blocks/prompt x block bytes x hit / ratio
    memory          = write GB/s x reuse window x Redis overhead    (an LRU keeps what was written
                      within the window; a prefix reused within it hits)
    masters by CPU  = spread x (write/node_put + read/node_get) / (cpu_util x io_speedup)
    masters by NIC  = spread x max(write, read / readers + replicas x write) / (NIC x nic_util)
    masters by mem  = memory / (node memory x mem_util)

``readers`` is 1 (reads go to masters, as the remote tier does today) or 1 + replicas with
``--read-from-replicas``. The masters needed is the largest of the three, which names the
bottleneck; per-node figures are then the cluster's over that many masters.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace

GB = 1e9
GiB = 1 << 30

# name -> (layers, KV heads, head_dim, bytes per element); Llama-3 8B and 70B, bf16
MODELS: dict[str, tuple[int, int, int, int]] = {"8B": (32, 8, 128, 2), "70B": (80, 8, 128, 2)}
REPLICAS = (10, 100, 1000)
BLOCK_TOKENS = (16, 256)


def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def blocks_per_prompt(prompt_tokens: int, block_tokens: int) -> int:
    return prompt_tokens // block_tokens


@dataclass(frozen=True)
class Inputs:
    # measured by bench_cluster (stored GB/s one node's command thread carries; codec; overhead):
    # the model_inputs of a full run (512 MiB per phase, 3 repeats) on a quiet 2-vCPU VM,
    # 2026-11-24, client and servers on the same 2 cores: 1 master, 2 MiB blocks, ours
    # (tools/bench/results/cluster-quiet.json; docs/scale.md)
    node_put_gbps: float = 1.135
    node_get_gbps: float = 2.677
    codec_ratio: float = 1.0  # raw (0.9998 measured: frame headers)
    compressed_ratio: float = 1.4668
    memory_overhead: float = 1.26
    # assumptions (flags)
    prompt_tokens: int = 4096
    req_per_s: dict = field(default_factory=lambda: {"8B": 4.0, "70B": 1.0})  # new prompts per replica
    hit_rate: float = 0.5  # share of full prompt blocks the remote tier serves
    write_fraction: float = 1.0  # share of missed blocks written (admission after N hits lowers it)
    reuse_window_s: float = 300.0  # a prefix must be reused within this to hit
    nic_gbit: float = 25.0  # per node, each direction
    nic_util: float = 0.7
    cpu_util: float = 0.7
    io_speedup: float = 1.0  # command-thread work per byte divided by this (io-threads, Valkey)
    node_memory_gib: float = 64.0  # maxmemory per node
    mem_util: float = 0.9
    replicas_per_master: int = 1
    read_from_replicas: bool = False
    spread: float = 1.1  # busiest node over the mean (bench_cluster's max/mean of a large run)
    block_tokens: int = 16  # the store's block (the engine's page) for the per-model tables


def load_inputs(path: str | None, **overrides) -> Inputs:
    """Defaults, then the measured fields of a bench_cluster JSON, then explicit overrides."""
    inp = Inputs()
    if path:
        with open(path) as fh:
            data = json.load(fh)
        measured = data.get("model_inputs", data)
        keys = ("node_put_gbps", "node_get_gbps", "codec_ratio", "compressed_ratio", "memory_overhead")
        inp = replace(inp, **{k: float(measured[k]) for k in keys if measured.get(k)})
    return replace(inp, **{k: v for k, v in overrides.items() if v is not None})


def plan(model: str, replicas: int, inp: Inputs, block_tokens: int | None = None) -> dict:
    """Cluster loads, the masters each limit needs, and per-node figures at the largest."""
    bt = block_tokens or inp.block_tokens
    bpt = bytes_per_token(*MODELS[model])
    block = bpt * bt
    blocks = blocks_per_prompt(inp.prompt_tokens, bt)
    prompts = replicas * inp.req_per_s[model]
    stored_block = block / inp.codec_ratio
    write = prompts * blocks * stored_block * (1 - inp.hit_rate) * inp.write_fraction / GB
    read = prompts * blocks * stored_block * inp.hit_rate / GB
    memory = write * GB * inp.reuse_window_s * inp.memory_overhead
    readers = 1 + inp.replicas_per_master if inp.read_from_replicas else 1
    nic = inp.nic_gbit / 8 * inp.nic_util
    need = {
        "cpu": inp.spread * (write / inp.node_put_gbps + read / inp.node_get_gbps) / (inp.cpu_util * inp.io_speedup),
        "nic": inp.spread * max(write, read / readers + inp.replicas_per_master * write) / nic,
        "memory": memory / (inp.node_memory_gib * GiB * inp.mem_util),
    }
    masters = max(1, *(math.ceil(v - 1e-9) for v in need.values()))
    return {"model": model, "replicas": replicas, "block_tokens": bt, "bytes_per_token": bpt,
            "block_bytes": block, "blocks_per_prompt": blocks, "prompts_per_s": prompts,
            "write_gbps": write, "read_gbps": read, "ops_per_s": (write + read) * GB / stored_block,
            "memory_bytes": memory, "masters_by": need, "masters": masters,
            "bottleneck": max(need, key=need.get), "nodes": masters * (1 + inp.replicas_per_master),
            "node_write_gbps": inp.spread * write / masters, "node_read_gbps": inp.spread * read / masters,
            "node_memory_gib": memory / masters / GiB}


def _g(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}" if x >= 10 else f"{x:.2f}"


def _table(head: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def sizes_table(inp: Inputs) -> str:
    rows = []
    for m, dims in MODELS.items():
        bpt = bytes_per_token(*dims)
        for bt in BLOCK_TOKENS:
            rows.append([m, f"{bpt:,} ({bpt // 1024} KiB)", bt, f"{bpt * bt / (1 << 20):g} MiB",
                         blocks_per_prompt(inp.prompt_tokens, bt),
                         f"{bpt * inp.prompt_tokens / (1 << 20):g} MiB"])
    return _table(["model", "bytes/token", "block tokens", "block", f"blocks/prompt ({inp.prompt_tokens} tok)",
                   "KV/prompt"], rows)


def capacity_rows(inp: Inputs, variants=None) -> list[dict]:
    return [plan(m, r, inp, bt) for m in MODELS for r in REPLICAS for bt in (variants or (inp.block_tokens,))]


def capacity_table(rows: list[dict]) -> str:
    head = ["model", "replicas", "block tok", "write GB/s", "read GB/s", "ops/s", "memory GiB",
            "masters by CPU / NIC / mem", "masters", "bottleneck", "node write / read GB/s", "node GiB"]
    body = [[p["model"], p["replicas"], p["block_tokens"], _g(p["write_gbps"]), _g(p["read_gbps"]),
             _g(p["ops_per_s"]), _g(p["memory_bytes"] / GiB),
             " / ".join(_g(p["masters_by"][k]) for k in ("cpu", "nic", "memory")), p["masters"],
             p["bottleneck"], f"{_g(p['node_write_gbps'])} / {_g(p['node_read_gbps'])}",
             _g(p["node_memory_gib"])] for p in rows]
    return _table(head, body)


def throughput_table(rows: list[dict]) -> str:
    """Traffic and the masters CPU and NIC need (memory aside), per-node figures at that count."""
    head = ["model", "replicas", "block tok", "write GB/s", "read GB/s", "ops/s", "masters by CPU / NIC",
            "node write / read GB/s"]
    body = []
    for p in rows:
        m = max(1, math.ceil(max(p["masters_by"]["cpu"], p["masters_by"]["nic"]) - 1e-9))
        body.append([p["model"], p["replicas"], p["block_tokens"], _g(p["write_gbps"]), _g(p["read_gbps"]),
                     _g(p["ops_per_s"]), f"{_g(p['masters_by']['cpu'])} / {_g(p['masters_by']['nic'])}",
                     f"{_g(p['node_write_gbps'] * p['masters'] / m)} / {_g(p['node_read_gbps'] * p['masters'] / m)}"])
    return _table(head, body)


WINDOWS_S = (60, 300, 900)
WORKING_SETS = (1_000_000, 10_000_000, 100_000_000)


def window_memory_table(inp: Inputs) -> str:
    """Memory an LRU needs to keep everything written within the reuse window."""
    rows = []
    for m in MODELS:
        for r in REPLICAS:
            cells = []
            for w in WINDOWS_S:
                p = plan(m, r, replace(inp, reuse_window_s=float(w)))
                cells.append(f"{_g(p['memory_bytes'] / GiB)} GiB / {math.ceil(p['masters_by']['memory'] - 1e-9)}")
            rows.append([m, r, *cells])
    return _table(["model", "replicas", *(f"window {w} s: memory / masters" for w in WINDOWS_S)], rows)


def working_set_bytes(model: str, tokens: int, inp: Inputs) -> float:
    """Redis memory for ``tokens`` of shared prefixes kept resident."""
    return tokens * bytes_per_token(*MODELS[model]) / inp.codec_ratio * inp.memory_overhead


def working_set_table(inp: Inputs) -> str:
    """Memory and masters for a working set of shared prefixes (replica count does not matter)."""
    rows = []
    for m in MODELS:
        cells = []
        for t in WORKING_SETS:
            b = working_set_bytes(m, t, inp)
            cells.append(f"{_g(b / GiB)} GiB / {math.ceil(b / (inp.node_memory_gib * GiB * inp.mem_util) - 1e-9)}")
        rows.append([m, *cells])
    return _table(["model", *(f"{t / 1e6:g}M tokens: memory / masters" for t in WORKING_SETS)], rows)


def hit_rate_table(inp: Inputs, model: str = "8B", replicas: int = 100) -> str:
    rows = []
    for h in (0.25, 0.5, 0.75, 0.9):
        p = plan(model, replicas, replace(inp, hit_rate=h))
        rows.append([h, _g(p["write_gbps"]), _g(p["read_gbps"]), _g(p["memory_bytes"] / GiB),
                     p["masters"], p["bottleneck"]])
    return _table(["hit rate", "write GB/s", "read GB/s", "memory GiB", "masters", "bottleneck"], rows)


LEVERS = {
    "as measured": {},
    "zstd+shuffle codec": "compressed",
    "100 Gb NIC": {"nic_gbit": 100.0},
    "io-threads / Valkey (x2 assumed)": {"io_speedup": 2.0},
    "reads from replicas": {"read_from_replicas": True},
    "admit after 2 hits (half the writes, assumed)": {"write_fraction": 0.5},
    "256 GiB nodes": {"node_memory_gib": 256.0},
}


def levers_table(inp: Inputs, model: str = "70B", replicas: int = 100) -> str:
    rows = []
    for name, change in LEVERS.items():
        if change == "compressed":
            change = {"codec_ratio": inp.compressed_ratio, "memory_overhead": 1.05}
        p = plan(model, replicas, replace(inp, **change))
        by = p["masters_by"]
        rows.append([name, " / ".join(_g(by[k]) for k in ("cpu", "nic", "memory")), p["masters"], p["bottleneck"]])
    return _table(["change", "masters by CPU / NIC / mem", "masters", "bottleneck"], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Capacity model of a Redis Cluster shared by many replicas.")
    p.add_argument("--inputs", help="bench_cluster.py --json output (its model_inputs), or such an object")
    p.add_argument("--json", action="store_true", help="print the plans as JSON")
    for name, kind in (("hit_rate", float), ("prompt_tokens", int), ("reuse_window_s", float),
                       ("nic_gbit", float), ("node_memory_gib", float), ("io_speedup", float),
                       ("replicas_per_master", int), ("write_fraction", float), ("spread", float),
                       ("block_tokens", int), ("node_put_gbps", float), ("node_get_gbps", float),
                       ("codec_ratio", float)):
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    p.add_argument("--read-from-replicas", action="store_true", default=None)
    a = vars(p.parse_args(argv))
    path, as_json = a.pop("inputs"), a.pop("json")
    inp = load_inputs(path, **a)
    if as_json:
        print(json.dumps({"inputs": asdict(inp), "plans": capacity_rows(inp, BLOCK_TOKENS)}, indent=1))
        return 0
    print("## Inputs\n\n```\n" + json.dumps(asdict(inp), indent=1) + "\n```\n")
    print("## Sizes\n\n" + sizes_table(inp) + "\n")
    print("## Throughput (block 16 and 256 tokens)\n\n" + throughput_table(capacity_rows(inp, BLOCK_TOKENS)) + "\n")
    print("## Memory: everything written within the reuse window\n\n" + window_memory_table(inp) + "\n")
    print("## Memory: a working set of shared prefixes\n\n" + working_set_table(inp) + "\n")
    print(f"## Plan (window {inp.reuse_window_s:g} s, block {inp.block_tokens} tokens)\n\n"
          + capacity_table(capacity_rows(inp)) + "\n")
    print("## Hit rate, 8B x 100 replicas\n\n" + hit_rate_table(inp) + "\n")
    print("## Levers, 70B x 100 replicas\n\n" + levers_table(inp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
