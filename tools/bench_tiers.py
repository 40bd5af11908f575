#!/usr/bin/env python
"""Benchmark every tier of TieredStore against this machine's limits, measured in the same run.

    python tools/bench_tiers.py [--json] [--blocks N] [--small-blocks M] [--repeats R]
                                [--redis-url URL] [--dir DIR] [--quick]

Two block sizes, both bf16, KV-like data (per-channel means and scales, a few outlier channels),
generated once and reused everywhere:

- ``2MiB``: Llama-8B-like, ``[32 layers, K/V, 16 tokens, 8 KV heads, 128]``;
- ``64KiB``: one layer of the same, ``[1, 2, 16, 8, 128]`` (the 2 MiB blocks cut per layer).

For each, in every repeat and close together in time (the machine is shared and noisy, so only
ratios taken in one run mean anything):

- limits: memcpy into pre-touched memory on 1 and 2 threads (plain memcpy via numpy; plus, as a
  diagnostic, torch ``copy_`` with torch's own OpenMP threads); BlockCodec encode /
  decode at the store's codec settings on 1 and 2 threads across blocks, and plain zstd-1; one
  raw file written sequentially + fsync'd, read warm and cold; redis-py SET / GET one at a time
  (and ``redis-benchmark`` when installed); the naive baseline, one ``torch.save`` file per block
  (copied out first), with and without fsync, ``torch.load`` + copy warm and cold (torch held
  to one intra-op thread there, so the baseline measures files and not OpenMP stalls);
- the store: host save / load, LMDB write-behind (save of every block until it is committed to
  LMDB, and until ``flush()`` made it durable) and the engine-visible part of it (until ``save()`` returned), LMDB restore warm and
  cold (a fresh store on the same directory with a host tier of two load batches, so every block
  comes from disk; ``load_into`` one batch at a time), Redis write-behind and restore (remote
  tier only);
- ratios against the targets, each with a pass flag.

GB/s are 1e9 bytes of uncompressed payload per second; figures are medians over ``--repeats``.
Temporary files and the redis-server this script starts are removed at exit.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ctypes
import gc
import io
import json
import mmap
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # a script, not a package: make the project importable from a checkout
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import zstandard  # noqa: E402

from tiered_kv.codec import BlockCodec  # noqa: E402
from tiered_kv.config import TieredKVConfig  # noqa: E402
from tiered_kv.keys import Namespace, block_keys  # noqa: E402
from tiered_kv.store import TieredStore  # noqa: E402

GB = 1e9
MiB = 1 << 20

# name -> (namespace fields, batch of blocks per save/load call)
SIZES: dict[str, dict[str, Any]] = {
    "2MiB": {"num_layers": 32, "batch": 32},
    "64KiB": {"num_layers": 1, "batch": 256},
}
KV = {"num_kv_heads": 8, "head_dim": 128, "block_size": 16, "dtype": "bfloat16"}

TARGETS = [
    # (name, store figure, bound figure, minimum ratio, what it means)
    ("host_save_vs_memcpy", "store.host_save", "limits.memcpy", 0.7,
     "store.save into host slots vs memcpy into pre-touched memory (best of 1 and 2 threads)"),
    ("host_load_vs_memcpy", "store.host_load", "limits.memcpy", 0.7,
     "load_into from host hits vs memcpy into pre-touched memory (best of 1 and 2 threads)"),
    ("lmdb_write_behind_vs_compress", "store.lmdb_write_behind", "limits.codec_encode_2t", 0.7,
     "save -> every block committed to LMDB vs BlockCodec encode on 2 threads"),
    ("lmdb_restore_warm_vs_decompress", "store.lmdb_restore_warm", "limits.codec_decode_2t", 0.7,
     "load_into from LMDB, page cache warm vs BlockCodec decode on 2 threads"),
    ("lmdb_restore_cold_vs_naive_cold", "store.lmdb_restore_cold", "limits.naive_load_cold", 1.0,
     "load_into from LMDB, page cache dropped vs torch.load + copy per file, cold"),
    ("redis_write_behind_vs_redis_py_set", "store.redis_write_behind", "limits.redis_py_set", 0.7,
     "save -> flush() with a Redis tier vs redis-py SET of the raw payloads one at a time"),
    ("redis_restore_vs_redis_py_get", "store.redis_restore", "limits.redis_py_get", 0.7,
     "load_into from Redis vs redis-py GET of the raw payloads one at a time"),
    ("save_vs_naive_save", "store.save_visible", "limits.naive_save", 3.0,
     "what the engine waits for: store.save() with an LMDB tier attached (write-behind queued) "
     "vs torch.save per block (no fsync)"),
]
# Context, not targets: the durable save against the synced naive save, and which part of the
# machine bounds a tier: the slower of the codec on 2 threads and the medium moving the compressed
# bytes (all payload GB/s, same run).
EXTRA_TARGETS = [
    ("durable_save_vs_naive_save_fsync", "store.lmdb_durable_save", "limits.naive_save_fsync", 3.0,
     "durable save: save -> flush() (LMDB synced) vs torch.save + fsync per block"),
    ("lmdb_write_behind_vs_durable_bound", "store.lmdb_durable_save", "limits.bound_durable_write", 0.7,
     "vs min(BlockCodec encode 2t, raw file write+fsync x compression ratio)"),
    ("lmdb_restore_cold_vs_cold_read_bound", "store.lmdb_restore_cold", "limits.bound_cold_read", 0.7,
     "vs min(BlockCodec decode 2t, raw file cold read x compression ratio)"),
    ("redis_write_behind_vs_encoded_set_bound", "store.redis_write_behind", "limits.bound_redis_write", 0.7,
     "vs min(BlockCodec encode 2t, redis-py SET of the encoded blobs)"),
    ("redis_restore_vs_encoded_get_bound", "store.redis_restore", "limits.bound_redis_read", 0.7,
     "vs min(BlockCodec decode 2t, redis-py GET of the encoded blobs)"),
]
DERIVED = {  # name -> (codec figure, medium figure, scale the medium by the compression ratio)
    "limits.bound_durable_write": ("limits.codec_encode_2t", "limits.file_write_fsync", True),
    "limits.bound_cold_read": ("limits.codec_decode_2t", "limits.file_read_cold", True),
    "limits.bound_redis_write": ("limits.codec_encode_2t", "limits.redis_py_set_encoded", False),
    "limits.bound_redis_read": ("limits.codec_decode_2t", "limits.redis_py_get_encoded", False),
}


# ---------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------
def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


class Figures:
    """Per (size, group.name): seconds of every repeat, and the bytes / blocks each moved."""

    def __init__(self) -> None:
        self.runs: dict[tuple[str, str], list[float]] = {}
        self.work: dict[tuple[str, str], tuple[int, int]] = {}
        self.notes: dict[tuple[str, str], dict] = {}
        self.errors: dict[tuple[str, str], str] = {}
        self.cpu: dict[tuple[str, str], list[float]] = {}  # process CPU seconds / wall seconds

    def add(self, size: str, name: str, timing: float | tuple[float, float], nbytes: int, nblocks: int,
            **notes) -> None:
        seconds, cpu = timing if isinstance(timing, tuple) else (timing, None)
        self.runs.setdefault((size, name), []).append(seconds)
        if cpu is not None and seconds >= 0.05:  # CPU clocks of other threads are too coarse below
            self.cpu.setdefault((size, name), []).append(cpu / seconds)
        self.work[(size, name)] = (nbytes, nblocks)
        if notes:
            self.notes.setdefault((size, name), {}).update(notes)

    def fail(self, size: str, name: str, exc: BaseException | str) -> None:
        text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        self.errors.setdefault((size, name), text)
        log(f"{size} {name}: {text}")

    def get(self, size: str, name: str) -> dict | None:
        runs = self.runs.get((size, name))
        if not runs:
            err = self.errors.get((size, name))
            return {"error": err} if err else None
        nbytes, nblocks = self.work[(size, name)]
        gbps = [nbytes / s / GB for s in runs]
        out = {
            "gbps": round(median(gbps), 3),
            "blocks_per_s": round(nblocks / median(runs), 1),
            "seconds": round(median(runs), 4),
            "runs_gbps": [round(g, 3) for g in gbps],
            "cpu_cores": round(median(self.cpu[(size, name)]), 2) if self.cpu.get((size, name)) else None,
        }
        out.update(self.notes.get((size, name), {}))
        if (size, name) in self.errors:
            out["error_in_some_runs"] = self.errors[(size, name)]
        return out

    def gbps_runs(self, size: str, name: str) -> list[float]:
        nbytes, _ = self.work.get((size, name), (0, 0))
        return [nbytes / s / GB for s in self.runs.get((size, name), [])]

    def names(self, size: str) -> list[str]:
        seen = [n for (s, n) in list(self.runs) + list(self.errors) if s == size]
        return list(dict.fromkeys(seen))


class Stopwatch:
    """Wall seconds and this process's CPU seconds (all threads) since it was made."""

    def __init__(self) -> None:
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()

    def lap(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall0, time.process_time() - self.cpu0


def run_parallel(fn: Callable[[int], Any], n: int, threads: int) -> tuple[float, float]:
    """Run ``fn(i)`` for i in range(n) on ``threads`` threads (contiguous chunks);
    (wall seconds, CPU seconds)."""
    if threads == 1:
        sw = Stopwatch()
        for i in range(n):
            fn(i)
        return sw.lap()
    bounds = [(n * t // threads, n * (t + 1) // threads) for t in range(threads)]
    barrier = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def work(lo: int, hi: int) -> None:
        barrier.wait()
        try:
            for i in range(lo, hi):
                fn(i)
        except BaseException as exc:  # reported below
            errors.append(exc)

    pool = [threading.Thread(target=work, args=b) for b in bounds]
    for t in pool:
        t.start()
    barrier.wait()
    sw = Stopwatch()
    for t in pool:
        t.join()
    timing = sw.lap()
    if errors:
        raise errors[0]
    return timing


@contextlib.contextmanager
def torch_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def as_np(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a contiguous CPU tensor's bytes."""
    return t.reshape(-1).view(torch.uint8).numpy()


# ---------------------------------------------------------------------------------------------
# page cache
# ---------------------------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_PAGE = mmap.PAGESIZE


def resident_bytes(path: str) -> tuple[int, int]:
    """(bytes of ``path`` in the page cache, file size), via mincore on a fresh mapping."""
    size = os.path.getsize(path)
    if size == 0:
        return 0, 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return -1, size
        try:
            pages = (size + _PAGE - 1) // _PAGE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                return -1, size
            resident = int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(size, resident * _PAGE), size


def files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


def resident_fraction(paths: Sequence[str]) -> float | None:
    got = total = 0
    for p in paths:
        r, s = resident_bytes(p)
        if r < 0:
            return None
        got += r
        total += s
    return round(got / total, 4) if total else None


class Evictor:
    """Drops files from the page cache: fsync + posix_fadvise(DONTNEED), plus drop_caches when
    this process may write /proc/sys/vm/drop_caches (tried once, reported)."""

    def __init__(self) -> None:
        self.drop_caches: str = "untried"

    def probe(self) -> None:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as fh:
                fh.write("1")
            self.drop_caches = "ok"
        except OSError as exc:
            self.drop_caches = f"not permitted ({type(exc).__name__}: {exc.strerror or exc})"

    @property
    def method(self) -> str:
        m = "fsync + posix_fadvise(POSIX_FADV_DONTNEED) per file"
        return m + (" + echo 1 > /proc/sys/vm/drop_caches" if self.drop_caches == "ok" else "")

    def evict(self, paths: Sequence[str]) -> None:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        if self.drop_caches == "ok":
            try:
                with open("/proc/sys/vm/drop_caches", "w") as fh:
                    fh.write("1")
            except OSError:
                pass


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------
def kv_like_blocks(n: int, shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    """bf16 blocks drawn like real KV: every (layer, K/V, head, channel) has its own mean and
    log-normal scale, and ~3 channels per head are outliers (20x mean and scale)."""
    g = torch.Generator().manual_seed(seed)
    stat = (shape[0], shape[1], 1, shape[3], shape[4])
    mean = torch.randn(stat, generator=g) * 0.5
    scale = torch.exp(torch.randn(stat, generator=g) * 0.5)
    outlier = torch.rand(stat, generator=g) < 3 / shape[4]
    mean = torch.where(outlier, mean * 20, mean)
    scale = torch.where(outlier, scale * 20, scale)
    with torch_threads(1):
        return [(torch.randn(shape, generator=g) * scale + mean).to(torch.bfloat16) for _ in range(n)]


def namespace(size: str, tag: str) -> Namespace:
    return Namespace(model_id=f"bench-tiers/llama-8b-like/{tag}", num_layers=SIZES[size]["num_layers"],
                     **KV)


def shape_of(size: str) -> tuple[int, ...]:
    return (SIZES[size]["num_layers"], 2, KV["block_size"], KV["num_kv_heads"], KV["head_dim"])


def keys_of(ns: Namespace, n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 128_000, size=n * ns.block_size).tolist()
    return block_keys(ns, tokens)


# ---------------------------------------------------------------------------------------------
# redis
# ---------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OwnRedis:
    """A redis-server on a free loopback port, no persistence, killed at exit."""

    def __init__(self, workdir: str, maxmemory: int) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server is not installed")
        self.port = free_port()
        self.workdir = workdir
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", workdir, "--maxmemory", str(maxmemory),
             "--maxmemory-policy", "noeviction", "--protected-mode", "no",
             "--proto-max-bulk-len", str(512 * MiB)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None


def redis_benchmark(host: str, port: int, size: int, n: int) -> dict:
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return {"error": "redis-benchmark not installed"}
    cmd = [exe, "-h", host, "-p", str(port), "-c", "1", "-P", "1", "-d", str(size), "-n", str(n),
           "-t", "set,get", "--csv"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return {"error": "redis-benchmark timed out"}
    out: dict = {}
    for row in csv.reader(io.StringIO(res.stdout)):
        if len(row) >= 2 and row[0] in ("SET", "GET"):
            try:
                rps = float(row[1])
            except ValueError:
                continue
            out[row[0].lower()] = {"gbps": round(rps * size / GB, 3), "ops_per_s": round(rps, 1)}
    if not out:
        out["error"] = f"no figures parsed (rc {res.returncode}): {res.stderr.strip()[:200]}"
    return out


# ---------------------------------------------------------------------------------------------
# the benchmark
# ---------------------------------------------------------------------------------------------
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
        cfg = TieredKVConfig()
        self.codec_name, self.codec_level = cfg.disk.codec, cfg.disk.level
        self.remote_codec = (cfg.remote.codec, cfg.remote.level)
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

    def make_store(self, size: str, tag: str, host_blocks: int, disk: str | None = None,
                   remote: str | None = None) -> TieredStore:
        ns = namespace(size, tag)
        total = len(self.data[size]) * self.data[size][0].numel() * 2
        cfg: dict = {
            "host": {"capacity": host_blocks * self.data[size][0].numel() * 2},
            "workers": 2,
            # the whole run fits: a dropped save would make the figure meaningless
            "max_inflight_save": 2 * total + 64 * MiB,
            "max_inflight_load": 2 * total + 64 * MiB,
        }
        if disk is not None:
            cfg["disk"] = {"url": f"lmdb://{disk}", "capacity": 4 * total + 256 * MiB}
        if remote is not None:
            cfg["remote"] = {"url": remote}
        return TieredStore(TieredKVConfig.from_dict(cfg), ns)

    # -- limits ------------------------------------------------------------------------------------
    def limits_memcpy(self, size: str) -> None:
        blocks = self.data[size]
        n, nb = len(blocks), blocks[0].numel() * 2
        src = [as_np(b) for b in blocks]
        dst_t = torch.empty((n, nb), dtype=torch.uint8)
        dst_t.fill_(1)  # touch every page
        dst = dst_t.numpy()
        for threads in (1, 2):
            secs = run_parallel(lambda i: np.copyto(dst[i], src[i]), n, threads)
            self.fig.add(size, f"limits.memcpy_{threads}t", secs, n * nb, n)
        typed = dst_t.view(blocks[0].dtype).view(n, *blocks[0].shape)
        secs = run_parallel(lambda i: typed[i].copy_(blocks[i]), n, 1)
        self.fig.add(size, "limits.torch_copy_default_threads", secs, n * nb, n,
                     torch_threads=torch.get_num_threads(),
                     what="torch copy_ per block with torch's own threads (diagnostic, no target)")
        best = min(self.fig.runs[(size, "limits.memcpy_1t")][-1],
                   self.fig.runs[(size, "limits.memcpy_2t")][-1])
        self.fig.add(size, "limits.memcpy", best, n * nb, n, what="best of memcpy_1t and memcpy_2t")

    def limits_codec(self, size: str) -> list[bytes]:
        blocks = self.data[size]
        n, nb = len(blocks), blocks[0].numel() * 2
        shape = tuple(blocks[0].shape)
        codec = BlockCodec(self.codec_name, self.codec_level)
        src = [as_np(b) for b in blocks]
        ns = b"\x11" * 16
        keys = [i.to_bytes(16, "little") for i in range(n)]
        blobs: list[bytes | None] = [None] * n

        def enc(i: int) -> None:
            blobs[i] = codec.encode(src[i], dtype="bfloat16", shape=shape, namespace=ns, key=keys[i])

        outs_t = torch.empty((n, nb), dtype=torch.uint8)
        outs_t.fill_(1)
        outs = outs_t.numpy()

        def dec(i: int) -> None:
            codec.decode(blobs[i], namespace=ns, key=keys[i], out=outs[i])

        for threads in (1, 2):
            self.fig.add(size, f"limits.codec_encode_{threads}t", run_parallel(enc, n, threads), n * nb, n,
                         codec=f"{self.codec_name} level {self.codec_level} (BlockCodec)")
            self.fig.add(size, f"limits.codec_decode_{threads}t", run_parallel(dec, n, threads), n * nb, n,
                         codec=f"{self.codec_name} level {self.codec_level} (BlockCodec)")
        assert all(np.array_equal(outs[i], src[i]) for i in (0, n - 1)), "codec round trip differs"
        stored = sum(len(b) for b in blobs)  # type: ignore[arg-type]
        # plain zstd level 1 on the raw bytes, for reference
        plain: list[bytes | None] = [None] * n
        ctx = threading.local()  # zstd contexts are per thread, made once

        def zc(i: int) -> None:
            if not hasattr(ctx, "c"):
                ctx.c = zstandard.ZstdCompressor(level=1)
            plain[i] = ctx.c.compress(src[i])

        def zd(i: int) -> None:
            if not hasattr(ctx, "d"):
                ctx.d = zstandard.ZstdDecompressor()
            ctx.d.decompress(plain[i], max_output_size=nb)

        self.fig.add(size, "limits.zstd1_compress_2t", run_parallel(zc, n, 2), n * nb, n,
                     codec="zstd level 1, raw bytes")
        self.fig.add(size, "limits.zstd1_decompress_2t", run_parallel(zd, n, 2), n * nb, n,
                     codec="zstd level 1, raw bytes (fresh output buffers)")
        plain_stored = sum(len(b) for b in plain)  # type: ignore[arg-type]
        self.compression.setdefault(size, {}).update({
            "store_codec": f"{self.codec_name} level {self.codec_level}",
            "store_codec_ratio": round(n * nb / stored, 4),
            "zstd1_ratio": round(n * nb / plain_stored, 4),
        })
        del outs_t
        return blobs  # type: ignore[return-value]

    def limits_raw_file(self, size: str) -> None:
        blocks = self.data[size]
        n, nb = len(blocks), blocks[0].numel() * 2
        d = self.tmpdir("raw")
        path = os.path.join(d, "raw.bin")
        src = [as_np(b) for b in blocks]
        sw = Stopwatch()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for buf in src:
                view = memoryview(buf)
                while view:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        self.fig.add(size, "limits.file_write_fsync", sw.lap(), n * nb, n,
                     what=f"one file, {format(nb, ',')}-byte sequential writes, then fsync")
        dst_t = torch.empty(n * nb, dtype=torch.uint8)
        dst_t.fill_(1)
        dst = memoryview(dst_t.numpy())
        step = max(nb, 8 * MiB)

        def read_all() -> tuple[float, float]:
            sw = Stopwatch()
            with open(path, "rb", buffering=0) as fh:
                off = 0
                while off < n * nb:
                    got = fh.readinto(dst[off:off + step])
                    if not got:
                        break
                    off += got
            return sw.lap()

        self.fig.add(size, "limits.file_read_warm", read_all(), n * nb, n)
        self.evictor.evict([path])
        self.residency.setdefault(f"{size}.file_read_cold", []).append(resident_fraction([path]))
        self.fig.add(size, "limits.file_read_cold", read_all(), n * nb, n)
        shutil.rmtree(d, ignore_errors=True)
        del dst_t

    def limits_naive(self, size: str) -> None:
        # one intra-op thread: torch's OpenMP copies collapse when a core is busy (see
        # limits.torch_copy_default_threads), and the baseline should measure files, not that
        with torch_threads(1):
            self._limits_naive(size)

    def _limits_naive(self, size: str) -> None:
        blocks = self.data[size]
        n, nb = len(blocks), blocks[0].numel() * 2
        d_plain, d_sync = self.tmpdir("naive"), self.tmpdir("naive-sync")

        def save_plain(i: int) -> None:
            torch.save(blocks[i].clone(), os.path.join(d_plain, f"{i}.pt"))

        def save_sync(i: int) -> None:
            with open(os.path.join(d_sync, f"{i}.pt"), "wb") as fh:
                torch.save(blocks[i].clone(), fh)
                fh.flush()
                os.fsync(fh.fileno())

        self.fig.add(size, "limits.naive_save", run_parallel(save_plain, n, 1), n * nb, n,
                     what="clone + torch.save per block, no fsync (torch 1 thread)")
        self.fig.add(size, "limits.naive_save_fsync", run_parallel(save_sync, n, 1), n * nb, n,
                     what="clone + torch.save + fsync per block (torch 1 thread)")
        dst = torch.empty((n, *blocks[0].shape), dtype=blocks[0].dtype)
        dst.view(torch.uint8).fill_(1)

        def load(i: int) -> None:
            dst[i].copy_(torch.load(os.path.join(d_sync, f"{i}.pt"), weights_only=True))

        self.fig.add(size, "limits.naive_load_warm", run_parallel(load, n, 1), n * nb, n,
                     what="torch.load + copy_ into a tensor, per file (torch 1 thread)")
        files = files_under(d_sync)
        self.evictor.evict(files)
        self.residency.setdefault(f"{size}.naive_load_cold", []).append(resident_fraction(files))
        self.fig.add(size, "limits.naive_load_cold", run_parallel(load, n, 1), n * nb, n,
                     what="torch.load + copy_ into a tensor, per file, page cache dropped (1 thread)")
        assert torch.equal(dst[n - 1], blocks[n - 1]), "naive round trip differs"
        shutil.rmtree(d_plain, ignore_errors=True)
        shutil.rmtree(d_sync, ignore_errors=True)

    def limits_redis(self, size: str, rep: int, blobs: list[bytes]) -> None:
        import redis

        blocks = self.data[size]
        n, nb = len(blocks), blocks[0].numel() * 2
        client = redis.Redis.from_url(self.redis_url, socket_timeout=30)
        prefix = f"bench-tiers:{self.run_id}:{size}:{rep}:".encode()
        keys = [prefix + b"raw:%d" % i for i in range(n)]
        ekeys = [prefix + b"enc:%d" % i for i in range(n)]
        payloads = [as_np(b).tobytes() for b in blocks]
        try:
            self.fig.add(size, "limits.redis_py_set",
                         run_parallel(lambda i: client.set(keys[i], payloads[i]), n, 1),
                         n * nb, n, what="redis-py SET of the raw payload, one at a time")
            got: list = [None] * n

            def get(i: int) -> None:
                got[i] = client.get(keys[i])

            self.fig.add(size, "limits.redis_py_get", run_parallel(get, n, 1), n * nb, n,
                         what="redis-py GET of the raw payload, one at a time")
            assert got[n - 1] == payloads[n - 1], "redis round trip differs"
            got = [None] * n
            # what the store ships: the encoded blobs (payload GB/s: raw bytes they carry)
            self.fig.add(size, "limits.redis_py_set_encoded",
                         run_parallel(lambda i: client.set(ekeys[i], blobs[i]), n, 1), n * nb, n,
                         what="redis-py SET of the store-encoded blobs, one at a time (payload GB/s)")
            self.fig.add(size, "limits.redis_py_get_encoded",
                         run_parallel(lambda i: client.get(ekeys[i]), n, 1), n * nb, n,
                         what="redis-py GET of the store-encoded blobs, one at a time (payload GB/s)")
            depth = 32

            def pipelined(op: str) -> tuple[float, float]:
                sw = Stopwatch()
                for lo in range(0, n, depth):
                    p = client.pipeline(transaction=False)
                    for i in range(lo, min(n, lo + depth)):
                        p.set(keys[i], payloads[i]) if op == "set" else p.get(keys[i])
                    p.execute()
                return sw.lap()

            self.fig.add(size, "limits.redis_py_set_pipelined32", pipelined("set"), n * nb, n)
            self.fig.add(size, "limits.redis_py_get_pipelined32", pipelined("get"), n * nb, n)
        finally:
            client.delete(*keys, *ekeys)
            client.close()
        if self.redis is not None:
            self.redis_bench.setdefault(size, []).append(
                redis_benchmark("127.0.0.1", self.redis.port, nb, n))

    # -- the store ---------------------------------------------------------------------------------
    def batches(self, size: str, keys: list[bytes]):
        b = SIZES[size]["batch"]
        data = self.data[size]
        for lo in range(0, len(keys), b):
            yield keys[lo:lo + b], data[lo:lo + b]

    def out_tensors(self, size: str) -> list[torch.Tensor]:
        b = min(SIZES[size]["batch"], len(self.data[size]))
        t = torch.empty((b, *self.data[size][0].shape), dtype=self.data[size][0].dtype)
        t.view(torch.uint8).fill_(1)
        return list(t.unbind(0))

    def restore(self, size: str, name: str, tier: str, keys: list[bytes], make: Callable[[], TieredStore],
                before: Callable[[], None] | None = None) -> None:
        """A fresh store (host tier of two batches: load_into stages in halves of it); load every
        key, one batch per load_into; check they all came from ``tier`` and the data is right."""
        data = self.data[size]
        n, nb = len(data), data[0].numel() * 2
        outs = self.out_tensors(size)
        if before is not None:
            before()
        t_open = time.perf_counter()
        store = make()
        opened = time.perf_counter() - t_open
        try:
            failed = 0
            sw = Stopwatch()
            for lo in range(0, n, len(outs)):
                ks = keys[lo:lo + len(outs)]
                ok = store.load_into(ks, outs[:len(ks)])
                failed += len(ks) - sum(ok)
            seconds = sw.lap()
            last = list(range(lo, lo + len(ks)))
            wrong = sum(not torch.equal(outs[j], data[i]) for j, i in enumerate(last))
            snap = store.stats()
        finally:
            store.close()
        served = {t: v["hits"] for t, v in snap["tiers"].items() if v["hits"]}
        notes = {"open_s": round(opened, 4), "batch": len(outs), "served_by": served}
        if served.get(tier, 0) != n:
            self.fig.fail(size, name, f"expected all {n} blocks from the {tier} tier, got {served}")
        if failed or wrong:
            misses = {t: v["misses"] for t, v in snap["tiers"].items() if v["misses"]}
            self.fig.fail(size, name, f"{failed} blocks not loaded, {wrong} differ in the last batch; "
                          f"misses {misses}, events {snap['events']}")
        self.fig.add(size, name, seconds, n * nb, n, **notes)

    def store_host(self, size: str, rep: int) -> None:
        data = self.data[size]
        n, nb = len(data), data[0].numel() * 2
        ns = namespace(size, f"{self.run_id}-host-{rep}")
        keys = keys_of(ns, n, seed=rep)
        store = self.make_store(size, f"{self.run_id}-host-{rep}", host_blocks=n)
        try:
            sw = Stopwatch()
            for ks, ps in self.batches(size, keys):
                store.save(ks, ps)
            self.fig.add(size, "store.host_save", sw.lap(), n * nb, n,
                         batch=SIZES[size]["batch"])
            outs = self.out_tensors(size)
            failed = 0
            sw = Stopwatch()
            for lo in range(0, n, len(outs)):
                ks = keys[lo:lo + len(outs)]
                failed += len(ks) - sum(store.load_into(ks, outs[:len(ks)]))
            self.fig.add(size, "store.host_load", sw.lap(), n * nb, n,
                         batch=len(outs))
            if failed or not torch.equal(outs[len(ks) - 1], data[n - 1]):
                self.fig.fail(size, "store.host_load", f"{failed} blocks not loaded or data differs")
        finally:
            store.close()

    def store_lmdb(self, size: str, rep: int) -> None:
        data = self.data[size]
        n, nb = len(data), data[0].numel() * 2
        tag = f"{self.run_id}-lmdb-{rep}"
        ns = namespace(size, tag)
        keys = keys_of(ns, n, seed=100 + rep)
        d = self.tmpdir("lmdb")
        try:
            store = self.make_store(size, tag, host_blocks=n, disk=d)
            try:
                sw = Stopwatch()
                for ks, ps in self.batches(size, keys):
                    store.save(ks, ps)
                visible = sw.lap()
                if not store.pool.drain(timeout=600):
                    raise RuntimeError("write-behind timed out")
                seconds = sw.lap()  # every block committed to LMDB: loadable by any process
                if not store.flush(timeout=600):
                    raise RuntimeError("flush timed out")
                durable = sw.lap()  # ... and fsync'd
                snap = store.stats()
            finally:
                store.close()
            t = snap["tiers"].get("disk", {})
            stored_in, blocks_in = t.get("stored_bytes_in", 0), t.get("blocks_in", 0)
            dropped = dict(snap.get("events", {}))
            self.fig.add(size, "store.save_visible", visible, n * nb, n,
                         what="until every store.save() returned (LMDB write-behind queued)")
            self.fig.add(size, "store.lmdb_write_behind", seconds, n * nb, n,
                         what="first save() until every block was committed to LMDB (encode + puts)")
            self.fig.add(size, "store.lmdb_durable_save", durable, n * nb, n,
                         what="first save() until flush() returned (encode + LMDB puts + fsync)")
            self.store_info.setdefault(size, {}).update({
                "lmdb_blocks_written": blocks_in, "lmdb_events": dropped,
                "lmdb_stored_ratio": round(n * nb / stored_in, 4) if stored_in else None,
                "lmdb_dir_bytes": sum(os.path.getsize(p) for p in files_under(d)),
            })
            if blocks_in != n:
                self.fig.fail(size, "store.lmdb_write_behind", f"only {blocks_in} of {n} blocks reached LMDB "
                              f"(events {dropped})")

            def make() -> TieredStore:
                return self.make_store(size, tag, host_blocks=2 * SIZES[size]["batch"], disk=d)

            self.restore(size, "store.lmdb_restore_warm", "disk", keys, make)

            def evict() -> None:
                files = files_under(d)
                if not files:
                    raise RuntimeError(f"the LMDB tier left no files under {d} to evict")
                self.evictor.evict(files)
                self.residency.setdefault(f"{size}.lmdb_restore_cold", []).append(resident_fraction(files))

            self.restore(size, "store.lmdb_restore_cold", "disk", keys, make, before=evict)
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def store_redis(self, size: str, rep: int) -> None:
        data = self.data[size]
        n, nb = len(data), data[0].numel() * 2
        tag = f"{self.run_id}-redis-{rep}"
        ns = namespace(size, tag)
        keys = keys_of(ns, n, seed=200 + rep)
        store = self.make_store(size, tag, host_blocks=n, remote=self.redis_url)
        try:
            try:
                sw = Stopwatch()
                for ks, ps in self.batches(size, keys):
                    store.save(ks, ps)
                if not store.flush(timeout=600):
                    raise RuntimeError("flush timed out")
                seconds = sw.lap()
                snap = store.stats()
            finally:
                store.close()
            blocks_in = snap["tiers"].get("remote", {}).get("blocks_in", 0)
            self.fig.add(size, "store.redis_write_behind", seconds, n * nb, n,
                         what="first save() until flush() returned (encode + Redis puts)")
            self.store_info.setdefault(size, {}).update({"redis_blocks_written": blocks_in,
                                                         "redis_events": dict(snap.get("events", {}))})
            if blocks_in != n:
                self.fig.fail(size, "store.redis_write_behind",
                              f"only {blocks_in} of {n} blocks reached Redis")

            def make() -> TieredStore:
                return self.make_store(size, tag, host_blocks=2 * SIZES[size]["batch"],
                                       remote=self.redis_url)

            self.restore(size, "store.redis_restore", "remote", keys, make)
        finally:
            self.drop_redis_namespace(ns)

    def drop_redis_namespace(self, ns: Namespace) -> None:
        """Free the server's memory: FLUSHALL on our own server, else delete this namespace's keys."""
        import redis

        client = redis.Redis.from_url(self.redis_url, socket_timeout=30)
        try:
            if self.redis is not None:
                client.flushall()
                return
            digest = ns.digest()
            batch = []
            for k in client.scan_iter(count=1000):
                if digest in k:
                    batch.append(k)
                    if len(batch) >= 500:
                        client.delete(*batch)
                        batch = []
            if batch:
                client.delete(*batch)
        finally:
            client.close()

    # -- driver ------------------------------------------------------------------------------------
    def step(self, size: str, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(size, *args)
        except Exception as exc:
            self.fig.fail(size, name, exc)
            return None
        finally:
            gc.collect()

    def run(self) -> None:
        for rep in range(self.args.repeats):
            for size in SIZES:
                log(f"repeat {rep + 1}/{self.args.repeats}, {size} blocks")
                self.step(size, "limits.memcpy", self.limits_memcpy)
                self.step(size, "store.host", self.store_host, rep)
                blobs = self.step(size, "limits.codec", self.limits_codec)
                self.step(size, "store.lmdb", self.store_lmdb, rep)
                self.step(size, "limits.file", self.limits_raw_file)
                self.step(size, "limits.naive", self.limits_naive)
                if self.redis_url is None:
                    self.fig.fail(size, "limits.redis_py", self.redis_error or "no redis")
                    self.fig.fail(size, "store.redis", self.redis_error or "no redis")
                    continue
                if blobs is not None:
                    self.step(size, "limits.redis_py", self.limits_redis, rep, blobs)
                self.step(size, "store.redis", self.store_redis, rep)
                blobs = None

    # -- report ------------------------------------------------------------------------------------
    def derive(self) -> None:
        """The DERIVED bounds, repeat by repeat: the slower of the codec and the medium."""
        for size in SIZES:
            ratio = self.compression.get(size, {}).get("store_codec_ratio")
            for name, (codec, medium, scaled) in DERIVED.items():
                a, b = self.fig.gbps_runs(size, codec), self.fig.gbps_runs(size, medium)
                if not a or not b or (scaled and not ratio):
                    continue
                nbytes, nblocks = self.fig.work[(size, codec)]
                for x, y in zip(a, b):
                    bound = min(x, y * ratio if scaled else y)
                    self.fig.add(size, name, nbytes / (bound * GB), nbytes, nblocks,
                                 what=f"min({codec.split('.')[1]}, {medium.split('.')[1]}"
                                      f"{' x compression ratio' if scaled else ''})")

    def ratios(self) -> list[dict]:
        out = []
        for size in SIZES:
            for extra, (name, num, den, target, what) in [(False, t) for t in TARGETS] + \
                    [(True, t) for t in EXTRA_TARGETS]:
                a, b = self.fig.get(size, num), self.fig.get(size, den)
                entry: dict = {"size": size, "name": name, "target": target, "store": num, "bound": den,
                               "what": what}
                if extra:
                    entry["extra"] = True
                if a and b and "gbps" in a and "gbps" in b:
                    ratio = a["gbps"] / b["gbps"]
                    ra, rb = self.fig.gbps_runs(size, num), self.fig.gbps_runs(size, den)
                    paired = [x / y for x, y in zip(ra, rb)]
                    entry.update({"store_gbps": a["gbps"], "bound_gbps": b["gbps"],
                                  "ratio": round(ratio, 3),
                                  "ratio_paired_median": round(median(paired), 3) if paired else None,
                                  "pass": bool(ratio >= target and "error_in_some_runs" not in a)})
                    if den == "limits.memcpy":  # the best-of bound: say how it compares to each
                        for t in ("1t", "2t"):
                            f = self.fig.get(size, f"limits.memcpy_{t}")
                            if f and "gbps" in f:
                                entry[f"ratio_vs_memcpy_{t}"] = round(a["gbps"] / f["gbps"], 3)
                else:
                    entry.update({"ratio": None, "pass": False,
                                  "error": (a or {}).get("error") or (b or {}).get("error")
                                  or "not measured"})
                out.append(entry)
        return out

    def machine(self) -> dict:
        def version(mod: str) -> str | None:
            try:
                from importlib.metadata import version as v

                return v(mod)
            except Exception:
                return None

        cpu = None
        with contextlib.suppress(OSError):
            for line in open("/proc/cpuinfo"):
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        mem = None
        with contextlib.suppress(OSError):
            for line in open("/proc/meminfo"):
                if line.startswith("MemTotal"):
                    mem = round(int(line.split()[1]) * 1024 / 2**30, 1)
        fs = None
        with contextlib.suppress(OSError):
            best = ""
            for line in open("/proc/mounts"):
                dev, mnt, typ = line.split()[:3]
                if os.path.realpath(self.base).startswith(mnt.rstrip("/") + "/") and len(mnt) > len(best):
                    best, fs = mnt, f"{typ} on {dev} at {mnt}"
        hiredis = None
        with contextlib.suppress(Exception):
            from redis.utils import HIREDIS_AVAILABLE

            hiredis = HIREDIS_AVAILABLE
        redis_server = None
        with contextlib.suppress(Exception):
            redis_server = subprocess.run(["redis-server", "--version"], capture_output=True, text=True,
                                          timeout=10).stdout.strip()
        return {
            "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)), "cpu_model": cpu,
            "mem_gib": mem, "kernel": platform.release(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "torch_parallel_backend": "OpenMP" if "OpenMP" in torch.__config__.parallel_info() else "other",
            "numpy": np.__version__, "zstandard": zstandard.__version__, "lmdb": version("lmdb"),
            "redis_py": version("redis"), "hiredis": version("hiredis"), "hiredis_in_use": hiredis,
            "redis_server": redis_server, "bench_dir_fs": fs, "cuda": torch.cuda.is_available(),
        }

    def report(self, started: Stopwatch, load_start: tuple) -> dict:
        sizes = {}
        for size in SIZES:
            d0 = self.data[size][0]
            entry: dict = {"shape": list(d0.shape), "dtype": "bfloat16", "block_bytes": d0.numel() * 2,
                           "blocks": len(self.data[size]), "batch": SIZES[size]["batch"],
                           "total_bytes": len(self.data[size]) * d0.numel() * 2}
            entry["compression"] = self.compression.get(size, {})
            entry["limits"] = {n.split(".", 1)[1]: self.fig.get(size, n) for n in self.fig.names(size)
                               if n.startswith("limits.") and self.fig.get(size, n) is not None}
            entry["store"] = {n.split(".", 1)[1]: self.fig.get(size, n) for n in self.fig.names(size)
                              if n.startswith("store.") and self.fig.get(size, n) is not None}
            if size in self.redis_bench:
                rb = self.redis_bench[size]
                entry["limits"]["redis_benchmark"] = {
                    op: {"gbps": median([r[op]["gbps"] for r in rb if op in r]),
                         "runs_gbps": [r[op]["gbps"] for r in rb if op in r]}
                    for op in ("set", "get") if any(op in r for r in rb)} or rb[0]
            entry["store_info"] = self.store_info.get(size, {})
            sizes[size] = entry
        ratios = self.ratios()
        return {
            "bench": "tiered-kv tiers vs machine limits",
            "machine": self.machine(),
            "settings": {
                "blocks_2MiB": len(self.data["2MiB"]), "blocks_64KiB": len(self.data["64KiB"]),
                "repeats": self.args.repeats, "quick": self.args.quick, "dir": self.base,
                "store_workers": 2, "disk_codec": f"{self.codec_name} level {self.codec_level}",
                "remote_codec": f"{self.remote_codec[0]} level {self.remote_codec[1]}",
                "redis": self.redis_url and (("own redis-server at " + self.redis_url) if self.redis
                                             else "given: " + self.redis_url),
                "redis_error": self.redis_error,
                "figures": "medians over repeats; gbps = 1e9 payload bytes/s; "
                           "ratio = store median / bound median",
            },
            "cache_eviction": {"method": self.evictor.method, "drop_caches": self.evictor.drop_caches,
                               "resident_fraction_after_evict": self.residency},
            "sizes": sizes,
            "ratios": ratios,
            "targets_passed": sum(r["pass"] for r in ratios if not r.get("extra")),
            "targets_total": sum(1 for r in ratios if not r.get("extra")),
            "loadavg": {"start": list(load_start), "end": list(os.getloadavg())},
            "elapsed_s": round(started.lap()[0], 1),
            "process_cpu_cores": round(started.lap()[1] / started.lap()[0], 2),
        }


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(160, shutil.get_terminal_size((160, 40)).columns))
    m = report["machine"]
    console.print(f"[bold]{report['bench']}[/] — {m['cpus']} CPUs ({m['cpu_model']}), {m['mem_gib']} GiB, "
                  f"torch {m['torch']} ({m['torch_threads']} threads), {m['bench_dir_fs']}; "
                  f"cache eviction: {report['cache_eviction']['method']} "
                  f"(drop_caches: {report['cache_eviction']['drop_caches']})")
    for size, entry in report["sizes"].items():
        t = Table(title=f"{size} blocks {entry['shape']} bf16 x {entry['blocks']} "
                        f"(compression {entry['compression']})")
        for col in ("figure", "GB/s", "blocks/s", "runs GB/s", "CPU cores", "note"):
            t.add_column(col, justify="right" if col in ("GB/s", "blocks/s") else "left")
        for group in ("limits", "store"):
            for name, f in entry[group].items():
                if f is None:
                    continue
                if "error" in f:
                    t.add_row(f"{group}.{name}", "-", "-", "", "", f"[red]{f['error']}[/]")
                    continue
                if "gbps" not in f:  # redis-benchmark
                    for op, g in f.items():
                        if isinstance(g, dict) and "gbps" in g:
                            t.add_row(f"{group}.{name}.{op}", f"{g['gbps']:.2f}", "",
                                      " ".join(f"{x:.2f}" for x in g.get("runs_gbps", [])), "", "")
                    continue
                note = f.get("what", f.get("codec", ""))
                t.add_row(f"{group}.{name}", f"{f['gbps']:.2f}", f"{f['blocks_per_s']:.0f}",
                          " ".join(f"{x:.2f}" for x in f["runs_gbps"]),
                          "" if f.get("cpu_cores") is None else f"{f['cpu_cores']:.2f}", note[:80])
        console.print(t)
    t = Table(title=f"targets: {report['targets_passed']}/{report['targets_total']} pass "
                    "(rows marked context: which of codec / medium bounds the tier, not targets)")
    for col in ("size", "target", "store GB/s", "bound GB/s", "ratio", "paired", "need", "pass"):
        t.add_column(col)
    for r in report["ratios"]:
        t.add_row(r["size"], r["name"] + (" (context)" if r.get("extra") else ""),
                  str(r.get("store_gbps", "-")), str(r.get("bound_gbps", "-")),
                  str(r["ratio"]) if r["ratio"] is not None else r.get("error", "-")[:40],
                  str(r.get("ratio_paired_median", "")), f"≥{r['target']}",
                  "[green]yes[/]" if r["pass"] else "[red]no[/]")
    console.print(t)
    console.print(f"elapsed {report['elapsed_s']} s, load average {report['loadavg']}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
        bench.derive()
        report = bench.report(started, load_start)
    finally:
        bench.close()
    if args.json:
        # one object; lists of numbers stay on one line so the figures read as a table
        text = json.dumps(report, indent=1)
        print(re.sub(r"\[\s*([-0-9.eE, \n]*?)\s*\]",
                     lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]"
                     if m.group(1).strip() else "[]", text))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
