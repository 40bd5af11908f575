"""Layer-wise reads of the disk tier beside whole-block reads of the same blocks and the machine's
own read of the same files, in one process, alternating, page cache warm and dropped:

    python tools/bench_layerwise.py [--json] [--blocks 256] [--rounds 6] [--groups 8] [--dir DIR]

The blocks (2 MiB, Llama-8B-like bf16 KV, ``layer_groups`` frames each, the default codec) are
saved once. Per round, each read runs in a new store, in load jobs of 32 blocks, into
preallocated buffers (checked byte for byte outside the timing): *layerwise* is
``read_layered`` (every block's head, then frame 0 of every block, then frame 1, ...: what a
GPU engine's layer-wise load does), *whole* is ``read_into`` (each block at once), and the
*limit* is ``preadv`` of every segment file in 2 MiB pieces by two threads into the same
destination memory, with no checks (the machine's read of those bytes). Reported: GB/s medians and the ratios layerwise / whole and
layerwise / limit. A benchmark, not a test: run it on a quiet machine.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "tools")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
from bench.common import median  # noqa: E402
from bench.data import kv_like_blocks, namespace, shape_of  # noqa: E402
from bench.pagecache import drop_page_cache, files_under  # noqa: E402

from tiered_kv.config import TieredKVConfig  # noqa: E402
from tiered_kv.keys import block_keys  # noqa: E402
from tiered_kv.store import TieredStore  # noqa: E402

JOB = 32  # blocks per read call (a load job)
PIECE = 2 << 20  # the limit's read size


def config(directory: str, nbytes: int, groups: int) -> TieredKVConfig:
    return TieredKVConfig.from_dict({
        "host": {"capacity": 64 * (2 << 20)}, "workers": 2, "layer_groups": groups,
        "max_inflight_save": 2 * nbytes + (64 << 20), "max_inflight_load": 2 * nbytes + (64 << 20),
        "disk": {"url": f"lmdb://{directory}", "capacity": 4 * nbytes + (256 << 20)}})


def read_tier(kind: str, directory: str, groups: int, ns, keys, outs) -> float:
    """Seconds a new store's disk tier takes to read every block into ``outs``."""
    nbytes = sum(o.nbytes for o in outs)
    store = TieredStore(config(directory, nbytes, groups), ns)
    try:
        disk = store.tier("disk")
        t0 = time.perf_counter()
        for lo in range(0, len(keys), JOB):
            if kind == "layerwise":
                reasons, _ = disk.read_layered(keys[lo : lo + JOB], outs[lo : lo + JOB], lambda ready, end: None)
            else:
                reasons, _ = disk.read_into(keys[lo : lo + JOB], outs[lo : lo + JOB])
            assert not any(reasons), f"{kind}: {reasons}"
        return time.perf_counter() - t0
    finally:
        store.close()


def read_files(directory: str, into: memoryview) -> tuple[float, int]:
    """Seconds two threads take to ``preadv`` every segment file (2 MiB pieces) into ``into``
    (as many distinct bytes as the store's reads land in; a buffer reused would stay in the
    CPU's caches), and the bytes read."""
    files = [f for f in files_under(directory) if f.endswith(".seg")]
    pieces, at = [], 0
    for f in files:
        for start in range(0, os.path.getsize(f), PIECE):
            pieces.append((f, start, at % (len(into) - PIECE + 1)))
            at += PIECE

    def part(k: int) -> int:
        done, fds = 0, {}
        try:
            for f, start, place in pieces[k::2]:
                fd = fds.get(f) or fds.setdefault(f, os.open(f, os.O_RDONLY))
                done += os.preadv(fd, [into[place : place + PIECE]], start)
        finally:
            for fd in fds.values():
                os.close(fd)
        return done

    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        total = sum(pool.map(part, range(2)))
    return time.perf_counter() - t0, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--blocks", type=int, default=256, help="2 MiB blocks (default 256)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds (default 6)")
    parser.add_argument("--groups", type=int, default=8, help="layer groups a block is framed in (default 8)")
    parser.add_argument("--dir", default=None, help="where the store goes (default: the temp dir)")
    args = parser.parse_args()
    blocks = kv_like_blocks(args.blocks, shape_of("2MiB"), seed=1234)
    ns = namespace("2MiB", "layerwise")
    keys = block_keys(ns, list(range(args.blocks * ns.block_size)))
    nbytes = sum(b.numel() * b.element_size() for b in blocks)
    directory = tempfile.mkdtemp(prefix="tkv-layerwise-", dir=args.dir)
    try:
        with TieredStore(config(directory, nbytes, args.groups), ns) as store:
            for lo in range(0, args.blocks, JOB):
                store.save(keys[lo : lo + JOB], blocks[lo : lo + JOB]).result(timeout=600)
            assert store.flush(timeout=600)
        os.sync()
        dst = torch.zeros((args.blocks, *blocks[0].shape), dtype=blocks[0].dtype)
        outs = [dst[i].view(-1).view(torch.uint8).numpy() for i in range(args.blocks)]
        into = memoryview(dst.view(-1).view(torch.uint8).numpy()).cast("B")  # (the limit's reads land there)
        runs: dict[str, list[float]] = {}
        for r in range(args.rounds):
            for cache in ("warm", "cold"):
                kinds = ["layerwise", "whole", "limit"]
                for kind in kinds if r % 2 == 0 else kinds[::-1]:
                    if cache == "cold":
                        drop_page_cache(directory, require_cold=True)
                    else:
                        read_files(directory, into)  # every byte in the page cache
                    if kind == "limit":
                        seconds, read = read_files(directory, into)
                        runs.setdefault(f"limit_{cache}", []).append(read / seconds / 1e9)
                        continue
                    dst.zero_()
                    seconds = read_tier(kind, directory, args.groups, ns, keys, outs)
                    assert all(torch.equal(dst[i], blocks[i]) for i in range(args.blocks)), f"{kind}: data differs"
                    runs.setdefault(f"{kind}_{cache}", []).append(nbytes / seconds / 1e9)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    medians = {k: median(v) for k, v in runs.items()}
    ratios = {f"layerwise_over_{other}_{cache}": medians[f"layerwise_{cache}"] / medians[f"{other}_{cache}"]
              for cache in ("warm", "cold") for other in ("whole", "limit")}
    report = {"blocks": args.blocks, "rounds": args.rounds, "groups": args.groups, "runs": runs,
              "median_GBps": medians, "ratios": ratios}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print("  ".join(f"{k} {v:.2f}" for k, v in medians.items()))
    print("  ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
