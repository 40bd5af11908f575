"""The benchmarks' own checks (tools/bench/): a restore figure verifies every block it restored,
a cold figure is checked cold, and bench_e2e's TTFT target passes only when the warm restarts
restored every stored block from the disk tier with the cold run's outputs."""

from __future__ import annotations

import mmap
import os
import sys
import types
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(TOOLS))
    try:
        from bench import e2e_parent, figures, pagecache, tiers

        yield types.SimpleNamespace(e2e_parent=e2e_parent, figures=figures, pagecache=pagecache, tiers=tiers)
    finally:
        sys.path.remove(str(TOOLS))


def small_blocks(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((1, 2, 16, 8, 128), generator=g).to(torch.bfloat16) for _ in range(n)]


def test_a_restore_that_serves_a_wrong_block_before_its_last_batch_does_not_pass_unflagged(
        bench, tmp_path, monkeypatch):
    """The LMDB restore figure compared only its last batch: a wrong block in any earlier batch
    was timed and reported as a good restore."""
    tiers = bench.tiers
    monkeypatch.setitem(tiers.SIZES["64KiB"], "batch", 4)
    expected = small_blocks(8, seed=1)
    b = types.SimpleNamespace(data={"64KiB": expected}, fig=bench.figures.Figures())
    stored = [x.clone() for x in expected]
    stored[1] = small_blocks(1, seed=2)[0]  # the store holds other bytes for block 1 (batch 1 of 2)
    keys = tiers.keys_of(tiers.namespace("64KiB", "t"), 8, seed=3)
    disk = str(tmp_path / "lmdb")
    os.makedirs(disk)
    with tiers.make_store(b, "64KiB", "t", host_blocks=8, disk=disk) as store:
        store.save(keys[:4], stored[:4])
        store.save(keys[4:], stored[4:])
        assert store.flush(timeout=60)

    def make():
        return tiers.make_store(b, "64KiB", "t", host_blocks=8, disk=disk)

    tiers.restore(b, "64KiB", "store.lmdb_restore_warm", "disk", keys, make)
    figure = b.fig.get("64KiB", "store.lmdb_restore_warm")
    assert figure["served_by"] == {"disk": 8}
    assert "1 differ" in figure["error_in_some_runs"]


def test_a_page_cache_drop_that_leaves_the_store_resident_is_not_reported_cold(bench, tmp_path):
    """A drop that cannot evict the store's pages (here: mapped by this process) used to be
    reported with its residency and used as a cold figure all the same."""
    from storage_backends.lmdb_disk import LmdbBackend

    disk = tmp_path / "lmdb"
    backend = LmdbBackend.from_url(f"lmdb://{disk}")
    backend.close()
    data = disk / "data.mdb"
    with open(data, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        sum(mapped[i] for i in range(0, len(mapped), mmap.PAGESIZE))  # every page resident and mapped
        drop = bench.pagecache.drop_page_cache(str(disk))
        assert drop["cold"] is False and "not cold" in drop["not_cold"]
        with pytest.raises(RuntimeError, match="not cold"):
            bench.pagecache.drop_page_cache(str(disk), require_cold=True)
    assert bench.pagecache.drop_page_cache(str(disk))["cold"] is True


def serve(matched: int, tiers: dict, output: list[int], page_cache: dict | None = None) -> dict:
    run = {"ttft_s": 0.01, "matched_tokens": matched, "tier_blocks": tiers, "prefilled_tokens": 1,
           "output": output, "first_logits": [0.0], "disk_stored_bytes": 1, "disk_blocks_written": 1}
    if page_cache is not None:
        run["page_cache"] = page_cache
    return run


@pytest.mark.parametrize("broken", ["restored_nothing", "other_output", "not_cold"])
def test_a_warm_restart_that_did_not_restore_from_a_cold_disk_does_not_pass_the_ttft_target(
        bench, tmp_path, monkeypatch, broken):
    """The TTFT target passed on the ratio alone: a warm restart that matched nothing, one whose
    output differed from the cold run's, or a "dropped" run whose store stayed in the page cache
    passed as a restore from disk."""
    parent = bench.e2e_parent
    length, blocks = 4096, 4095 // 16
    cold = {"dropped_mib": 0.0, "cold": True}

    def run_child(role, spec):
        if spec["variant"] == "cold":
            return {**serve(0, {}, [1, 2]), "ttft_s": 1.0}
        page = {"cold": True} if spec["variant"] == "dropped" else None
        if broken == "restored_nothing":
            return serve(0, {}, [1, 2], page)
        if broken == "other_output":
            return serve(blocks * 16, {"disk": blocks}, [1, 3], page)
        if page is not None:
            page = {"cold": False, "not_cold": "not cold: 90.0% of the files still in the page cache"}
        return serve(blocks * 16, {"disk": blocks}, [1, 2], page)

    monkeypatch.setattr(parent, "run_child", run_child)
    args = types.SimpleNamespace(no_drop=False, continue_tokens=0, lengths=[length], cold_repeats=1,
                                 repeats=1, load_modes=["whole"])
    [row], _ = parent.ttft_section(args, 8192, str(tmp_path))
    assert row["ratio_warm_over_cold"] <= row["target_ratio"]
    assert row["problems"] and row["pass"] is False

    def healthy(role, spec):
        if spec["variant"] == "cold":
            return {**serve(0, {}, [1, 2]), "ttft_s": 1.0}
        return serve(blocks * 16, {"disk": blocks}, [1, 2], cold if spec["variant"] == "dropped" else None)

    monkeypatch.setattr(parent, "run_child", healthy)
    [row], _ = parent.ttft_section(args, 8192, str(tmp_path))
    assert row["problems"] == [] and row["pass"] is True


@pytest.mark.parametrize("cuda", [False, True])
def test_regression_the_e2e_figure_of_a_cpu_engine_was_its_layer_wise_restore_which_auto_never_picks_there(
        bench, monkeypatch, cuda):
    """``warm_restart`` (and the TTFT ratio) reported the layer-wise loads as the default
    configuration's, while ``layerwise_loads = "auto"`` loads whole blocks on a CPU engine (here
    layer-wise ran 1.3-1.6x slower). Without CUDA the default's mode is whole. (CUDA's presence
    is set for each case: read from the machine, the case without it never ran on a GPU host,
    and there the test passed on the old code.)"""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    expected = "layerwise" if cuda else "whole"
    assert bench.e2e_parent._default_mode(["whole", "layerwise"]) == expected
    assert bench.e2e_parent._default_mode(["layerwise", "whole"]) == expected
    only = "whole" if cuda else "layerwise"  # (only what was measured: the mode asked for)
    assert bench.e2e_parent._default_mode([only]) == only
