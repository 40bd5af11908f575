"""bench_cluster's run: the command line, the clusters (one at a time, each started for its
repeats and stopped after), the phases in alternating order (ours first in even repeats, raw
first in odd ones, so a drifting machine does not favour one), the report."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

import redis

from .cluster_crypto import measure, overhead, seal_blocks
from .cluster_data import KINDS, encode_blocks, ratio_with, remote_codec
from .cluster_report import build, table
from .cluster_run import per_master_bytes, run_path
from .cluster_servers import BenchCluster, missing_tools
from .common import log
from .machine import cpu_model

DESCRIPTION = ("Redis Cluster put / get GB/s through the store's remote tier beside plain redis-py, "
               "on clusters of 1 and 3 masters started for the run.")
MiB = 1 << 20


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--quick", action="store_true", help="a smoke run (~30 s): few blocks, one repeat")
    p.add_argument("--masters", default="1,3", help="comma-separated cluster sizes (default 1,3)")
    p.add_argument("--replicas", type=int, default=0, help="replicas per master (default 0)")
    p.add_argument("--mib", type=int, default=None,
                   help="MiB of payload per kind and phase (default 512; quick 64)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"block kinds (default {','.join(KINDS)})")
    p.add_argument("--repeats", type=int, default=None, help="repeats, medians reported (default 3; quick 1)")
    p.add_argument("--workers", type=int, default=None,
                   help="client threads, as the store's transfer threads (default: the store's)")
    p.add_argument("--io-threads", type=int, default=1, help="redis-server io-threads (default 1: off)")
    p.add_argument("--server", default="redis-server",
                   help="server binary (e.g. valkey-server; clusters are still formed by redis-cli)")
    p.add_argument("--codec", default=None, help="codec override (default: the remote tier's, resolved)")
    p.add_argument("--raw-pipeline-mib", type=float, default=0,
                   help="cut raw redis-py pipelines to this many MiB of values (default 0: one per job)")
    p.add_argument("--no-check", action="store_true", help="skip comparing a few blocks after each get")
    p.add_argument("--encrypt", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure encryption at rest (default on): sealing and opening on the client "
                        "on 1 and the store's threads, and ours put / get with sealed blocks")
    p.add_argument("--dir", default=None, help="where the servers' directories go (default: temp dir)")
    a = p.parse_args(argv)
    a.mib = a.mib or (64 if a.quick else 512)
    a.repeats = a.repeats or (1 if a.quick else 3)
    a.masters = [int(x) for x in a.masters.split(",") if x]
    a.kinds = [k for k in a.kinds.split(",") if k]
    if unknown := [k for k in a.kinds if k not in KINDS]:
        p.error(f"unknown kinds {unknown}; known: {list(KINDS)}")
    if a.mib < 1 or a.repeats < 1 or not a.masters or min(a.masters) < 1:
        p.error("--mib, --repeats and every --masters must be positive")
    if a.encrypt and importlib.util.find_spec("cryptography") is None:
        p.error("--encrypt needs the cryptography library (pip install 'tiered-kv[crypto]'); "
                "or pass --no-encrypt")
    return a


def meta(args: argparse.Namespace, codec: str, workers: int, load0: tuple) -> dict:
    try:
        server = subprocess.run([args.server, "--version"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except OSError:
        server = None
    return {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "quick": args.quick,
            "mib_per_phase": args.mib, "repeats": args.repeats, "workers": workers,
            "replicas": args.replicas, "io_threads": args.io_threads, "codec": codec,
            "raw_pipeline_mib": args.raw_pipeline_mib or "one pipeline per job",
            "encrypt": args.encrypt, "cpus": os.cpu_count(), "cpu_model": cpu_model(), "python": platform.python_version(),
            "redis_py": version("redis"), "hiredis": bool(redis.utils.HIREDIS_AVAILABLE),
            "redis_server": server, "loadavg_start": [round(x, 2) for x in load0],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
            "note": "client and servers share this machine: a node's ceiling is its command thread's "
                    "bytes per CPU second"}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if reason := missing_tools(args.server):
        log(f"cannot start a cluster: {reason}", "bench-cluster")
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):  # the finally below stops the servers
        signal.signal(sig, lambda s, _f: sys.exit(128 + s))
    load0 = os.getloadavg()
    codec, level, groups, store_workers = remote_codec(args.codec)
    workers = args.workers or store_workers
    encoded, codecs = {}, {}
    for kind in args.kinds:
        layers, heads, dim, dtype = KINDS[kind]
        payload = layers * 2 * 16 * heads * dim * (2 if dtype == "bfloat16" else 4)
        n = max(2, args.mib * MiB // payload)
        log(f"encoding {n} {kind} blocks with {codec}", "bench-cluster")
        enc = encode_blocks(kind, n, f"run-{os.getpid()}", codec, level, groups)
        encoded[kind] = enc
        codecs[kind] = {"codec": codec, "level": level, "segments": enc.segments, "blocks": n,
                        "payload_bytes_per_block": enc.payload_bytes, "ratio": round(enc.ratio, 4),
                        "zstd_shuffle_ratio": round(ratio_with(enc, "zstd+shuffle", level, groups), 4)}
    sealed, crypto_records, encryption = {}, [], None
    if args.encrypt:
        for kind, enc in encoded.items():
            sealed[kind] = seal_blocks(enc, groups)
        for rep in range(args.repeats):  # kinds alternate within each repeat, as the cluster phases do
            for kind, enc in encoded.items():
                crypto_records += measure(enc, sealed[kind], groups, (1, workers), 1, rep,
                                          lambda m: log(m, "bench-cluster"))
        encryption = {"cipher": "AES-256-GCM, a key per tenant (HKDF of the secret), frame by frame",
                      "tenant": "one (a throwaway secret)", "threads": sorted({1, workers}),
                      "stored": {kind: overhead(encoded[kind], sealed[kind]) for kind in sealed}}
    records: list[dict] = []
    base = Path(tempfile.mkdtemp(prefix="bench-cluster-", dir=args.dir))
    try:
        for masters in args.masters:
            cluster = BenchCluster(base / f"m{masters}", masters, args.replicas,
                                   maxmemory=0, io_threads=args.io_threads,
                                   server=args.server)
            log(f"starting a cluster of {masters} master(s) + {args.replicas} replica(s) each", "bench-cluster")
            cluster.start()
            try:
                owners = cluster.slot_owners()
                for rep in range(args.repeats):
                    for kind, plain in encoded.items():
                        blocks = {"ours": plain, "raw": plain, "ours_sealed": sealed.get(kind)}
                        order = ("ours", "raw", "ours_sealed") if kind in sealed else ("ours", "raw")
                        for path in (order if rep % 2 == 0 else order[::-1]):
                            enc = blocks[path]
                            node_bytes = per_master_bytes(enc, owners, len(cluster.masters))
                            log(f"{masters} master(s), repeat {rep + 1}/{args.repeats}, {kind}, {path}",
                                "bench-cluster")
                            phases = run_path("ours" if path == "ours_sealed" else path, cluster, enc, workers,
                                              not args.no_check, int(args.raw_pipeline_mib * MiB))
                            for op, ph in phases.items():
                                records.append({"kind": kind, "masters": masters, "path": path, "op": op,
                                                "rep": rep, "blocks": len(enc.blobs),
                                                "payload_bytes": len(enc.blobs) * enc.payload_bytes,
                                                "stored_bytes": enc.stored_bytes, "node_bytes": node_bytes,
                                                **{k: v for k, v in ph.items() if k != "done"}})
            finally:
                cluster.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report = build(records, codecs, meta(args, codec, workers, load0), crypto_records, encryption)
    report["records"] = records
    if args.encrypt:
        report["crypto_records"] = crypto_records
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(table(report))
    return 0
