"""tools/bench/cluster_report.py and the job shapes of cluster_run: medians, paired ours / raw
ratios, per-node spread and the capacity model's inputs, from made-up phase records (no cluster)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(TOOLS))
    try:
        from bench import cluster_report, cluster_run

        yield cluster_report, cluster_run
    finally:
        sys.path.remove(str(TOOLS))


GB = 1e9


def record(path, op, rep, seconds, masters=1, cpu=None, node_bytes=None, memory=None):
    node_bytes = node_bytes or [int(GB)] * masters
    return {"kind": "llama8b-2MiB", "masters": masters, "path": path, "op": op, "rep": rep,
            "seconds": seconds, "client_cpu_s": 0.5, "server_cpu_s": cpu or [0.5] * masters,
            "blocks": 10, "payload_bytes": sum(node_bytes), "stored_bytes": sum(node_bytes),
            "node_bytes": node_bytes, **({"memory": memory} if memory else {})}


def test_medians_ratios_spread_and_model_inputs(bench):
    report_mod, _ = bench
    recs = []
    for rep, (ours, raw) in enumerate([(1.0, 2.0), (2.0, 2.0), (1.0, 4.0)]):  # seconds for 1 GB
        mem = [{"port": 1, "used_memory_delta": int(1.25 * GB), "keys": 10}]
        recs += [record("ours", "put", rep, ours, memory=mem), record("raw", "put", rep, raw, memory=mem),
                 record("ours", "get", rep, ours / 2), record("raw", "get", rep, raw / 2)]
    codecs = {"llama8b-2MiB": {"codec": "raw", "ratio": 0.9998, "zstd_shuffle_ratio": 1.47, "segments": 8}}
    report = report_mod.build(recs, codecs, {"note": "test"})
    entry = report["results"]["llama8b-2MiB"]["1"]
    assert entry["ours"]["put"]["payload_gbps"] == 1.0  # median of 1, 0.5, 1 GB/s
    assert entry["raw"]["put"]["payload_gbps"] == 0.5
    assert entry["ratio_ours_over_raw"]["put"] == 2.0  # paired per repeat: 2, 1, 4
    assert entry["ours"]["put"]["node_ceiling_gbps"] == [2.0]  # 1 GB per 0.5 CPU s
    assert entry["spread"]["max_over_mean"] == 1.0
    assert entry["spread"]["memory_overhead"] == 1.25
    inputs = report["model_inputs"]
    assert inputs["node_put_gbps"] == 2.0 and inputs["node_put_gbps_wall"] == 1.0
    assert inputs["codec_ratio"] == 0.9998 and inputs["compressed_ratio"] == 1.47
    assert "llama8b-2MiB" in report_mod.table(report)


def test_spread_over_three_masters(bench):
    report_mod, _ = bench
    nb = [int(0.5 * GB), int(1.0 * GB), int(1.5 * GB)]
    recs = [record(p, op, 0, 1.0, masters=3, node_bytes=nb, cpu=[0.25, None, 1.5])
            for p in ("ours", "raw") for op in ("put", "get")]
    report = report_mod.build(recs, {}, {})
    entry = report["results"]["llama8b-2MiB"]["3"]
    assert entry["spread"]["node_share"] == [pytest.approx(1 / 6, abs=1e-4), pytest.approx(1 / 3, abs=1e-4), 0.5]
    assert entry["spread"]["max_over_mean"] == 1.5
    assert entry["ours"]["put"]["node_ceiling_gbps"] == [2.0, None, 1.0]  # a node without CPU figures: None
    assert report["model_inputs"]["node_put_gbps_wall"] == 1.0  # 3 GB/s over 3 masters


def test_jobs_are_shaped_as_the_store_shapes_them(bench):
    _, run = bench
    two_mib = 2 << 20
    assert [len(r) for r in run.put_jobs(20, two_mib)] == [8, 8, 4]  # 16 MiB write-behind jobs
    assert [len(r) for r in run.get_jobs(64, two_mib, 2)] == [16, 16, 16, 16]  # 64 MiB batch / 2 threads
    jobs = run.get_jobs(1000, 128 << 10, 2)
    assert sum(len(r) for r in jobs) == 1000 and len(jobs[0]) == 256


def test_blocks_are_encoded_as_the_remote_tier_stores_them(bench):
    sys.path.insert(0, str(TOOLS))
    try:
        from bench.cluster_data import encode_blocks, ratio_with
    finally:
        sys.path.remove(str(TOOLS))
    enc = encode_blocks("demo-128KiB", 3, "test", "raw", 1, 8)
    assert enc.payload_bytes == 128 << 10 and enc.segments == 2 and len(enc.keys) == 3
    assert 0.99 < enc.ratio < 1.0  # raw bodies plus the header
    out = bytearray(enc.payload_bytes)
    digest = enc.namespace.digest()
    enc.block_codec.decode(enc.blobs[1], namespace=digest, key=enc.keys[1][len(digest):], out=out)
    assert bytes(out) == enc.raw[1].tobytes()
    assert ratio_with(enc, "zstd+shuffle", 1, 8) > 1.0


def crypto(op, rep, seconds, threads=1, cpu=None, gb=1.0):
    return {"kind": "llama8b-2MiB", "threads": threads, "op": op, "rep": rep, "seconds": seconds,
            "cpu_s": seconds if cpu is None else cpu, "blocks": 10, "payload_bytes": int(gb * GB)}


def test_crypto_figures_pair_sealed_with_plain_per_repeat(bench):
    report_mod, _ = bench
    recs = []
    for rep, (enc, seal, dec, opn) in enumerate([(0.25, 1.0, 0.2, 0.5), (0.5, 1.0, 0.25, 1.0), (0.25, 0.5, 0.2, 0.4)]):
        recs += [crypto("encode", rep, enc), crypto("encode+seal", rep, seal), crypto("seal", rep, seal - enc),
                 crypto("decode", rep, dec), crypto("open+decode", rep, opn)]
    recs += [crypto("encode", 0, 0.125, threads=2), crypto("encode+seal", 0, 0.5, threads=2, cpu=1.0)]
    figs = report_mod.crypto_figures(recs)
    one = figs["llama8b-2MiB"]["1"]
    assert one["encode"]["gbps"] == 4.0 and one["encode+seal"]["gbps"] == 1.0  # medians of 4, 2, 4 and 1, 1, 2
    assert one["write"]["sealed_over_plain"] == 0.5  # paired per repeat: 0.25, 0.5, 0.5
    assert one["write"]["added_s_per_gb"] == 0.5  # 0.75, 0.5, 0.25 s more per GB
    assert one["read"]["sealed_over_plain"] == 0.4  # 0.4, 0.25, 0.5
    assert one["read"]["cpu_sealed_over_plain"] == 2.5
    assert one["seal"]["repeats"] == 3
    two = figs["llama8b-2MiB"]["2"]
    assert two["write"]["sealed_over_plain"] == 0.25 and two["write"]["cpu_sealed_over_plain"] == 8.0
    assert "read" not in two  # no decode ran on 2 threads


def test_sealed_phases_beside_ours_and_the_encryption_table(bench):
    report_mod, _ = bench
    recs = []
    for rep, (ours, sealed) in enumerate([(1.0, 2.0), (1.0, 1.0), (2.0, 5.0)]):  # seconds for 1 GB of payload
        mem = [{"port": 1, "used_memory_delta": int(1.25 * GB), "keys": 10}]
        recs += [record("ours", "put", rep, ours, memory=mem), record("raw", "put", rep, ours, memory=mem),
                 record("ours", "get", rep, ours), record("raw", "get", rep, ours)]
        for op in ("put", "get"):  # sealed blocks: 1% more stored bytes, an odd memory growth
            r = record("ours_sealed", op, rep, sealed, memory=[{"port": 1, "used_memory_delta": int(9 * GB),
                                                                "keys": 10}] if op == "put" else None)
            r["stored_bytes"] = r["node_bytes"][0] = int(1.01 * GB)
            recs.append(r)
    stored = {"llama8b-2MiB": {"plain_stored_bytes_per_block": 2097496.0, "sealed_stored_bytes_per_block": 2097836.0,
                               "overhead_bytes_per_block": 340.0, "overhead_pct": 0.0162, "frames": 9,
                               "expected_overhead_bytes": 340}}
    report = report_mod.build(recs, {}, {"note": "test"}, [crypto("encode", 0, 0.25), crypto("encode+seal", 0, 1.0)],
                              {"cipher": "AES-256-GCM", "stored": stored})
    entry = report["results"]["llama8b-2MiB"]["1"]
    assert entry["ratio_sealed_over_ours"] == {"put": 0.5, "get": 0.5}  # 0.5, 1, 0.4 in payload GB/s
    assert entry["ratio_ours_over_raw"]["put"] == 1.0
    assert entry["ours_sealed"]["put"]["payload_gbps"] == 0.5 and entry["ours_sealed"]["put"]["wire_gbps"] == 0.505
    assert entry["spread"]["memory_overhead"] == 1.25  # from the plain phases only
    assert report["encryption"]["client"]["llama8b-2MiB"]["1"]["write"]["sealed_over_plain"] == 0.25
    text = report_mod.table(report)
    assert "encryption at rest (AES-256-GCM)" in text and "ours, sealed" in text and "(+340, 0.016%" in text
    plain = report_mod.build([r for r in recs if r["path"] != "ours_sealed"], {}, {})
    assert "encryption" not in plain and "ratio_sealed_over_ours" not in plain["results"]["llama8b-2MiB"]["1"]
    assert "encryption at rest" not in report_mod.table(plain)


def test_blocks_are_sealed_and_opened_by_the_remote_tier(bench):
    pytest.importorskip("cryptography")
    sys.path.insert(0, str(TOOLS))
    try:
        from bench.cluster_crypto import OPS, measure, overhead, seal_blocks
        from bench.cluster_data import encode_blocks
    finally:
        sys.path.remove(str(TOOLS))
    enc = encode_blocks("demo-128KiB", 3, "test", "raw", 1, 8)  # 2 segments: 3 sealed frames
    sealed = seal_blocks(enc, 8)
    assert sealed.keys == enc.keys and all(s != p for s, p in zip(sealed.blobs, enc.blobs))
    st = overhead(enc, sealed)
    assert st["frames"] == 3 and st["overhead_bytes_per_block"] == st["expected_overhead_bytes"] == 124
    recs = measure(enc, sealed, 8, (1, 2), 1)  # checks a sealed block opens to its payload first
    assert sorted((r["threads"], r["op"]) for r in recs) == sorted((t, op) for t in (1, 2) for op in OPS)
    assert all(r["blocks"] == 3 and r["seconds"] > 0 for r in recs)


def test_encryption_is_measured_unless_turned_off(bench):
    sys.path.insert(0, str(TOOLS))
    try:
        from bench.cluster_main import parse
    finally:
        sys.path.remove(str(TOOLS))
    assert parse(["--quick", "--no-encrypt"]).encrypt is False
    if importlib.util.find_spec("cryptography") is not None:
        assert parse(["--quick"]).encrypt is True
