"""Two disk-tier configurations side by side in one process, alternating A B B A ...: the way to
compare them on a machine whose page-cache writes swing several-fold from one minute to the next
(a comparison across runs then says more about the machine than about the store).

    python tools/bench_disk_ab.py [--json] [--blocks 256] [--rounds 8]
        [--a "pages=?segment_min=1GiB"] [--b "segments="] [--dir DIR]

Each side is ``name=URL-options`` appended to ``lmdb://DIR``. Per round and side, on a fresh
directory: a ``TieredStore`` (2 workers, the default codec) saves the blocks (2 MiB, Llama-8B-like
bf16 KV) until every one is committed to LMDB (*write*), then until ``flush`` and ``os.sync``
returned (*write+sync*); a new store loads them all into preallocated tensors, page cache warm
(*warm restore*), then again after the store's files left the page cache (*cold restore*), each
checked byte for byte outside the timing. Reported: GB/s medians per side and
the ratio B / A. A benchmark, not a test: run it on a quiet machine. Two identical sides
(an A/A run) differed by up to 1.8x in write and 1.4x in write+sync medians over 8 rounds
in one hour of this 2-vCPU VM (tools/bench/results/disk-ab-writeback-2026-11-24-ninth.json):
run an A/A beside any A/B whose difference is under that.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "tools")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
from bench.common import median  # noqa: E402
from bench.data import kv_like_blocks, namespace, shape_of  # noqa: E402
from bench.pagecache import drop_page_cache  # noqa: E402

from tiered_kv.config import TieredKVConfig  # noqa: E402
from tiered_kv.keys import block_keys  # noqa: E402
from tiered_kv.store import TieredStore  # noqa: E402

BATCH = 32  # blocks per save() / load_into() call


def config(directory: str, options: str, nbytes: int, host_blocks: int, block_nbytes: int) -> TieredKVConfig:
    return TieredKVConfig.from_dict({
        "host": {"capacity": host_blocks * block_nbytes}, "workers": 2,
        "max_inflight_save": 2 * nbytes + (64 << 20), "max_inflight_load": 2 * nbytes + (64 << 20),
        "disk": {"url": f"lmdb://{directory}{options}", "capacity": 4 * nbytes + (256 << 20)}})


def one_round(side: str, options: str, blocks: list[torch.Tensor], dst: torch.Tensor, tag: int,
              parent: str | None) -> dict[str, float]:
    n, block_nbytes = len(blocks), blocks[0].numel() * blocks[0].element_size()
    nbytes = n * block_nbytes
    ns = namespace("2MiB", f"ab-{side}-{tag}")
    keys = block_keys(ns, [(tag * 7919 + i) % 50_000 for i in range(n * ns.block_size)])[:n]
    directory = tempfile.mkdtemp(prefix="tkv-ab-", dir=parent)
    try:
        store = TieredStore(config(directory, options, nbytes, n, block_nbytes), ns)
        try:
            t0 = time.perf_counter()
            futures = [store.save(keys[i : i + BATCH], blocks[i : i + BATCH]) for i in range(0, n, BATCH)]
            for future in futures:
                if future is not None:
                    future.result(timeout=600)
            t1 = time.perf_counter()
            assert store.flush(timeout=600)
            os.sync()
            t2 = time.perf_counter()
            assert store.stats()["tiers"]["disk"]["blocks_in"] == n
        finally:
            store.close()
        figures = {"write": nbytes / (t1 - t0) / 1e9, "write_sync": nbytes / (t2 - t0) / 1e9}
        for phase in ("warm_restore", "cold_restore"):
            if phase == "cold_restore":
                drop_page_cache(directory, require_cold=True)
            figures[phase] = nbytes / restore(side, directory, options, keys, blocks, dst, ns) / 1e9
        return figures
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def restore(side: str, directory: str, options: str, keys: list, blocks: list[torch.Tensor], dst: torch.Tensor,
            ns) -> float:
    """Seconds a new store takes to load every block into ``dst`` (checked after)."""
    n, block_nbytes = len(blocks), blocks[0].numel() * blocks[0].element_size()
    dst.zero_()
    outs = [dst[i] for i in range(n)]
    store = TieredStore(config(directory, options, n * block_nbytes, 2 * BATCH, block_nbytes), ns)
    try:
        t0 = time.perf_counter()
        found = []
        for i in range(0, n, BATCH):
            found += store.load_into(keys[i : i + BATCH], outs[i : i + BATCH])
        seconds = time.perf_counter() - t0
    finally:
        store.close()
    assert all(found), f"{side}: {found.count(False)} blocks missing"
    assert all(torch.equal(dst[i], blocks[i]) for i in range(n)), f"{side}: data differs"
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--blocks", type=int, default=256, help="2 MiB blocks per round (default 256)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds per side (default 8)")
    parser.add_argument("--a", default="pages=?segment_min=1GiB", help="side A: name=URL options")
    parser.add_argument("--b", default="segments=", help="side B: name=URL options")
    parser.add_argument("--dir", default=None, help="where the stores go (default: the temp dir)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="unrecorded rounds of side A first (default 1: a process's first store pays "
                             "first-use costs, which went to side A's first round alone)")
    args = parser.parse_args()
    sides = [tuple(s.split("=", 1)) for s in (args.a, args.b)]
    blocks = kv_like_blocks(args.blocks, shape_of("2MiB"), seed=1234)
    dst = torch.stack(blocks).clone()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in sides}
    for r in range(args.warmup):
        one_round("warmup", sides[0][1], blocks, dst, args.rounds + r, args.dir)
    for r in range(args.rounds):
        for name, options in sides if r % 2 == 0 else sides[::-1]:
            runs[name].append(one_round(name, options, blocks, dst, r, args.dir))
    report = {"blocks": args.blocks, "rounds": args.rounds, "sides": dict(sides), "runs": runs,
              "median_GBps": {name: {k: median([run[k] for run in rs]) for k in rs[0]} for name, rs in runs.items()}}
    (a, _), (b, _) = sides
    report["ratio_b_over_a"] = {k: report["median_GBps"][b][k] / report["median_GBps"][a][k]
                                for k in report["median_GBps"][a]}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for name in (a, b):
        print(f"{name:12s}", "  ".join(f"{k} {v:.2f}" for k, v in report["median_GBps"][name].items()))
    print(f"{b} / {a}:", "  ".join(f"{k} {v:.2f}x" for k, v in report["ratio_b_over_a"].items()))


if __name__ == "__main__":
    main()
