"""bench_tiers' run: the command line, the ``Bench`` that holds one run's state (the generated
blocks, the figures, the temporary directory, the redis-server of its own, the page-cache
evictor), sets it up and tears it down, and drives every repeat: for each block size the limits
and the store's tiers close together in time, then the derived bounds and the report."""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tiered_kv.config import TieredKVConfig

from . import limits, tiers
from .common import MiB, Stopwatch, log
from .data import SIZES, kv_like_blocks, namespace, shape_of
from .figures import Figures
from .internals import codec_choice, smallest_frame
from .pagecache import Evictor
from .redis_server import OwnRedis
from .targets import derive
from .tiers_report import build_report, print_json, print_table

DESCRIPTION = "Benchmark every tier of TieredStore against this machine's limits, measured in the same run."


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.fig = Figures()
        self.evictor = Evictor()
        self.base = tempfile.mkdtemp(prefix="bench-tiers-", dir=args.dir)
        self.run_id = uuid.uuid4().hex[:8]
        self.redis: OwnRedis | None = None
        self.redis_url: str | None = args.redis_url
        self.redis_error: str | None = None
        self.redis_bench: dict[str, list[dict]] = {}
        self.residency: dict[str, list] = {}
        self.compression: dict[str, dict] = {}
        self.store_info: dict[str, dict] = {}
        # the codecs the store writes: "auto" (the default) resolved as the store resolves it
        # when it opens (measured once per process, so the limits and the stores agree)
        cfg = TieredKVConfig()
        self.codec_setting = {"disk": cfg.disk.codec, "remote": cfg.remote.codec}
        # (measured on the 2 MiB blocks' frames; a store of the 64 KiB blocks measures its own)
        frame = smallest_frame(namespace("2MiB", "codec"), 2 * MiB, cfg.layer_groups)
        self.codec_name = codec_choice.choose(cfg.disk.codec, tiers.WORKERS, frame_bytes=frame)
        self.codec_level = cfg.disk.level
        self.remote_codec = (codec_choice.choose(cfg.remote.codec, tiers.WORKERS, frame_bytes=frame),
                             cfg.remote.level)
        self.data: dict[str, list[torch.Tensor]] = {}

    # -- setup / teardown ------------------------------------------------------------------------
    def setup(self) -> None:
        a = self.args
        log(f"generating {a.blocks} x 2 MiB KV-like blocks (+ {a.small_blocks} x 64 KiB cut per layer)")
        big = kv_like_blocks(a.blocks, shape_of("2MiB"), seed=1234)
        if a.small_blocks > a.blocks * 32:
            raise SystemExit("--small-blocks may be at most 32 x --blocks (they are cut per layer)")
        small = [big[i // 32][i % 32: i % 32 + 1].clone() for i in range(a.small_blocks)]
        self.data = {"2MiB": big, "64KiB": small}
        self.evictor.probe()
        if self.redis_url is None:
            total = sum(b.numel() * 2 for b in big) + sum(b.numel() * 2 for b in small)
            try:
                rdir = os.path.join(self.base, "redis")
                os.makedirs(rdir)
                self.redis = OwnRedis(rdir, maxmemory=int(3 * total) + 512 * MiB)
                self.redis_url = self.redis.url
            except Exception as exc:
                self.redis_error = f"{type(exc).__name__}: {exc}"
                log(f"no redis: {self.redis_error}")

    def close(self) -> None:
        if self.redis is not None:
            self.redis.stop()
        shutil.rmtree(self.base, ignore_errors=True)

    def tmpdir(self, name: str) -> str:
        path = os.path.join(self.base, f"{name}-{uuid.uuid4().hex[:6]}")
        os.makedirs(path)
        return path

    # -- driver ------------------------------------------------------------------------------------
    def step(self, size: str, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(self, size, *args)
        except Exception as exc:
            self.fig.fail(size, name, exc)
            return None
        finally:
            gc.collect()

    def run(self) -> None:
        for rep in range(self.args.repeats):
            for size in SIZES:
                log(f"repeat {rep + 1}/{self.args.repeats}, {size} blocks")
                self.step(size, "limits.memcpy", limits.memcpy)
                self.step(size, "store.host", tiers.store_host, rep)
                blobs = self.step(size, "limits.codec", limits.codec)
                self.step(size, "store.lmdb", tiers.store_lmdb, rep)
                self.step(size, "limits.file", limits.raw_file)
                self.step(size, "limits.naive", limits.naive)
                if self.redis_url is None:
                    self.fig.fail(size, "limits.redis_py", self.redis_error or "no redis")
                    self.fig.fail(size, "store.redis", self.redis_error or "no redis")
                    continue
                if blobs is not None:
                    self.step(size, "limits.redis_py", limits.redis_py, rep, blobs)
                self.step(size, "store.redis", tiers.store_redis, rep)
                blobs = None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--blocks", type=int, default=None, help="2 MiB blocks (default 128; quick 24)")
    p.add_argument("--small-blocks", type=int, default=None,
                   help="64 KiB blocks (default 8 x --blocks; at most 32 x --blocks)")
    p.add_argument("--repeats", type=int, default=None, help="repeats, medians reported (default 3; quick 1)")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting a redis-server")
    p.add_argument("--dir", default=None, help="where temporary files go (default: the system temp dir)")
    p.add_argument("--quick", action="store_true", help="a ~30 s smoke run")
    args = p.parse_args(argv)
    if args.blocks is None:
        args.blocks = 24 if args.quick else 128
    if args.small_blocks is None:
        args.small_blocks = 8 * args.blocks
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.blocks < 1 or args.small_blocks < 1 or args.repeats < 1:
        p.error("--blocks, --small-blocks and --repeats must be positive")
    started, load_start = Stopwatch(), os.getloadavg()
    # a kill still removes the temp dirs and stops the redis-server (the finally below)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    bench = Bench(args)
    try:
        bench.setup()
        bench.run()
        derive(bench.fig, bench.compression)
        report = build_report(bench, started, load_start)
    finally:
        bench.close()
    if args.json:
        print_json(report)
    else:
        print_table(report)
    return 0
