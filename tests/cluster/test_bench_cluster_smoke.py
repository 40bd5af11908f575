"""bench_cluster's pieces against a real one-master cluster of its own (formed by hand: redis-cli
refuses clusters of under three masters): a few small blocks through the store's remote tier and
through plain redis-py, then every server is gone. One cluster, a few seconds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def test_one_master_cluster_ours_and_raw_then_nothing_left(tmp_path):
    sys.path.insert(0, str(TOOLS))
    try:
        from bench.cluster_data import encode_blocks
        from bench.cluster_run import per_master_bytes, run_path
        from bench.cluster_servers import BenchCluster, missing_tools
    finally:
        sys.path.remove(str(TOOLS))
    if reason := missing_tools():
        pytest.skip(reason)
    enc = encode_blocks("demo-128KiB", 6, "smoke", "raw", 1, 8)
    cluster = BenchCluster(tmp_path / "c", masters=1).start()
    try:
        assert cluster.slot_owners() == [0] * 16384
        assert per_master_bytes(enc, cluster.slot_owners(), 1) == [enc.stored_bytes]
        for path in ("ours", "raw"):
            phases = run_path(path, cluster, enc, workers=2, check=True)
            assert phases["put"]["done"] == phases["get"]["done"] == 6
            assert phases["put"]["memory"][0]["keys"] == 6
            assert cluster.master_memory()[0]["keys"] == 0  # emptied after each path
    finally:
        cluster.stop()
    assert all(n.proc.poll() is not None for n in cluster.nodes)
    assert not (tmp_path / "c").exists()
