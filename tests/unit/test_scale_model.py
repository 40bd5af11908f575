"""tools/scale_model.py: the capacity model's arithmetic (docs/scale.md's tables come from it)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "tools" / "scale_model.py"


@pytest.fixture(scope="module")
def sm():
    spec = importlib.util.spec_from_file_location("scale_model_under_test", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_bytes_per_token_of_llama_3(sm):
    assert sm.bytes_per_token(*sm.MODELS["8B"]) == 2 * 32 * 8 * 128 * 2 == 131_072
    assert sm.bytes_per_token(*sm.MODELS["70B"]) == 2 * 80 * 8 * 128 * 2 == 327_680


def test_only_full_blocks_count(sm):
    assert sm.blocks_per_prompt(4096, 16) == 256
    assert sm.blocks_per_prompt(4096, 256) == 16
    assert sm.blocks_per_prompt(4000, 256) == 15


def test_plan_loads_and_masters(sm):
    inp = replace(sm.Inputs(), node_put_gbps=1.0, node_get_gbps=2.0, codec_ratio=1.0, hit_rate=0.5,
                  prompt_tokens=4096, req_per_s={"8B": 1.0, "70B": 1.0}, spread=1.0, cpu_util=1.0,
                  nic_gbit=80.0, nic_util=1.0, replicas_per_master=1, reuse_window_s=10.0,
                  memory_overhead=1.0, node_memory_gib=1.0, mem_util=1.0, write_fraction=1.0)
    p = sm.plan("8B", 10, inp)
    per_prompt = 256 * 2 * 1024 * 1024  # 256 blocks of 2 MiB
    assert p["write_gbps"] == pytest.approx(10 * per_prompt * 0.5 / 1e9)
    assert p["read_gbps"] == pytest.approx(p["write_gbps"])
    assert p["ops_per_s"] == pytest.approx(10 * 256)
    assert p["memory_bytes"] == pytest.approx(p["write_gbps"] * 1e9 * 10)
    w = p["write_gbps"]
    assert p["masters_by"]["cpu"] == pytest.approx(w / 1.0 + w / 2.0)
    assert p["masters_by"]["nic"] == pytest.approx(max(w, w + 1 * w) / 10.0)  # reads + replication out
    assert p["masters_by"]["memory"] == pytest.approx(p["memory_bytes"] / 2**30)
    assert p["masters"] == math.ceil(max(p["masters_by"].values()))
    assert p["bottleneck"] == max(p["masters_by"], key=p["masters_by"].get)


def test_compression_and_replica_reads_lower_the_need(sm):
    base = sm.plan("70B", 100, sm.Inputs())
    packed = sm.plan("70B", 100, replace(sm.Inputs(), codec_ratio=1.5))
    assert packed["write_gbps"] == pytest.approx(base["write_gbps"] / 1.5)
    replicas = sm.plan("70B", 100, replace(sm.Inputs(), read_from_replicas=True))
    assert replicas["masters_by"]["nic"] < base["masters_by"]["nic"]
    assert replicas["masters_by"]["cpu"] == base["masters_by"]["cpu"]


def test_inputs_come_from_a_bench_cluster_report(sm, tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"model_inputs": {"node_put_gbps": 3.0, "node_get_gbps": None,
                                                 "codec_ratio": 1.4, "memory_overhead": 1.1}}))
    inp = sm.load_inputs(str(path), hit_rate=0.8)
    assert (inp.node_put_gbps, inp.codec_ratio, inp.memory_overhead, inp.hit_rate) == (3.0, 1.4, 1.1, 0.8)
    assert inp.node_get_gbps == sm.Inputs().node_get_gbps  # a missing figure keeps the default


def test_the_script_prints_every_table(sm, capsys):
    assert sm.main([]) == 0
    out = capsys.readouterr().out
    for title in ("## Sizes", "## Throughput", "## Memory", "## Plan", "## Hit rate", "## Levers"):
        assert title in out
    assert sm.main(["--json", "--hit-rate", "0.9"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert len(plans) == len(sm.MODELS) * len(sm.REPLICAS) * len(sm.BLOCK_TOKENS)
