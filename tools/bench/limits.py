"""This machine's limits, measured by bench_tiers in the same run as the store (each function
adds its figures as ``limits.*`` to the run's ``Figures``): memcpy into pre-touched memory on 1
and 2 threads (and torch ``copy_`` as a diagnostic); BlockCodec encode / decode with the codec the
store writes (``auto`` resolved) and plain zstd-1; one raw file written (page cache), fsync'd, and
read warm (also block by block with each block hashed: a checked read) and cold; the naive
baseline of one ``torch.save`` file per block; redis-py SET / GET round trips (raw, encoded,
pipelined) and ``redis-benchmark`` on our own server."""

from __future__ import annotations

import mmap
import os
import shutil
import threading
from typing import TYPE_CHECKING

import numpy as np
import torch
import xxhash
import zstandard

from .common import MiB, Stopwatch
from .data import as_np, touched
from .figures import run_parallel, torch_threads
from .internals import HEADER_BYTES, BlockCodec
from .pagecache import files_under, not_cold, resident_fraction
from .redis_server import redis_benchmark

if TYPE_CHECKING:
    from .tiers_main import Bench


def memcpy(b: Bench, size: str) -> None:
    blocks = b.data[size]
    n, nb = len(blocks), blocks[0].numel() * 2
    src = [as_np(x) for x in blocks]
    dst_t = touched((n, nb))
    dst = dst_t.numpy()
    for threads in (1, 2):
        secs = run_parallel(lambda i: np.copyto(dst[i], src[i]), n, threads)
        b.fig.add(size, f"limits.memcpy_{threads}t", secs, n * nb, n)
    typed = dst_t.view(blocks[0].dtype).view(n, *blocks[0].shape)
    secs = run_parallel(lambda i: typed[i].copy_(blocks[i]), n, 1)
    b.fig.add(size, "limits.torch_copy_default_threads", secs, n * nb, n,
              torch_threads=torch.get_num_threads(),
              what="torch copy_ per block with torch's own threads (diagnostic, no target)")
    best = min(b.fig.runs[(size, "limits.memcpy_1t")][-1],
               b.fig.runs[(size, "limits.memcpy_2t")][-1])
    b.fig.add(size, "limits.memcpy", best, n * nb, n, what="best of memcpy_1t and memcpy_2t")


def codec_label(name: str, level: int) -> str:
    return name if name == "raw" else f"{name} level {level}"


def codec(b: Bench, size: str) -> list[memoryview]:
    """Encode / decode figures; returns the encoded blobs (redis_py ships them too)."""
    blocks = b.data[size]
    n, nb = len(blocks), blocks[0].numel() * 2
    shape = tuple(blocks[0].shape)
    block_codec = BlockCodec(b.codec_name, b.codec_level)
    label = f"{codec_label(b.codec_name, b.codec_level)} (BlockCodec)"
    src = [as_np(x) for x in blocks]
    ns = b"\x11" * 16
    keys = [i.to_bytes(16, "little") for i in range(n)]
    # encoded into memory touched once, as the store's write-behind encodes into its arenas
    arena_t = touched((n, HEADER_BYTES + nb))
    arena = arena_t.numpy()
    blobs: list = [None] * n

    def enc(i: int) -> None:
        blobs[i] = block_codec.encode(src[i], dtype="bfloat16", shape=shape, namespace=ns, key=keys[i],
                                      into=arena[i])

    outs_t = touched((n, nb))
    outs = outs_t.numpy()

    def dec(i: int) -> None:
        block_codec.decode(blobs[i], namespace=ns, key=keys[i], out=outs[i])

    for threads in (1, 2):
        b.fig.add(size, f"limits.codec_encode_{threads}t", run_parallel(enc, n, threads), n * nb, n,
                  codec=label)
        b.fig.add(size, f"limits.codec_decode_{threads}t", run_parallel(dec, n, threads), n * nb, n,
                  codec=label)
    assert all(np.array_equal(outs[i], src[i]) for i in (0, n - 1)), "codec round trip differs"
    stored = sum(len(x) for x in blobs)
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

    b.fig.add(size, "limits.zstd1_compress_2t", run_parallel(zc, n, 2), n * nb, n,
              codec="zstd level 1, raw bytes")
    b.fig.add(size, "limits.zstd1_decompress_2t", run_parallel(zd, n, 2), n * nb, n,
              codec="zstd level 1, raw bytes (fresh output buffers)")
    plain_stored = sum(len(x) for x in plain)  # type: ignore[arg-type]
    b.compression.setdefault(size, {}).update({
        "store_codec": codec_label(b.codec_name, b.codec_level),
        "store_codec_compresses": b.codec_name != "raw",
        "store_codec_ratio": round(n * nb / stored, 4),  # raw: header only, just under 1
        "zstd1_ratio": round(n * nb / plain_stored, 4),
    })
    if b.codec_name == "raw":  # what compressing would store, for reference (a few blocks)
        z = BlockCodec("zstd+shuffle", b.codec_level)
        few = range(min(n, 8))
        zs = sum(len(z.encode(src[i], dtype="bfloat16", shape=shape, namespace=ns, key=keys[i])) for i in few)
        b.compression[size]["zstd_shuffle_ratio_sample"] = round(len(few) * nb / zs, 4)
    del outs_t
    return blobs


def direct_write(path: str, src: list, total: int) -> float | None:
    """Seconds to write ``src`` (arrays of bytes, ``total`` in all) to ``path`` with
    ``O_DIRECT`` in 8 MiB pieces, then fdatasync; None where the file system refuses it (or
    the write fails). The file is removed either way."""
    piece = 8 * MiB
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
    stage = mmap.mmap(-1, piece)  # page-aligned, as O_DIRECT needs
    view = memoryview(stage)
    fd = -1
    try:
        fd = os.open(path, flags, 0o644)
        sw, off, fill = Stopwatch(), 0, 0
        for buf in src:
            data = memoryview(buf).cast("B")
            while data:
                take = min(len(data), piece - fill)
                view[fill:fill + take] = data[:take]
                fill, data = fill + take, data[take:]
                if fill == piece or off + fill == total:
                    padded = -(-fill // 4096) * 4096
                    if os.pwrite(fd, view[:padded], off) != padded:
                        return None  # (a short direct write: no figure)
                    off, fill = off + fill, 0
        os.ftruncate(fd, total)  # (the last piece was padded to a page)
        os.fdatasync(fd)
        return sw.lap()
    except OSError:
        return None
    finally:
        if fd >= 0:
            os.close(fd)
        if os.path.exists(path):  # (Linux creates the file before it refuses O_DIRECT)
            os.unlink(path)
        view.release()
        stage.close()


def raw_file(b: Bench, size: str) -> None:
    blocks = b.data[size]
    n, nb = len(blocks), blocks[0].numel() * 2
    d = b.tmpdir("raw")
    path = os.path.join(d, "raw.bin")
    src = [as_np(x) for x in blocks]
    sw = Stopwatch()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for buf in src:
            view = memoryview(buf)
            while view:
                view = view[os.write(fd, view):]
        written = sw.lap()  # in the page cache: another process can read it
        os.fsync(fd)
        synced = sw.lap()
    finally:
        os.close(fd)
    b.fig.add(size, "limits.file_write", written, n * nb, n,
              what=f"one file, {format(nb, ',')}-byte sequential writes (page cache, before fsync)")
    b.fig.add(size, "limits.file_write_fsync", synced, n * nb, n,
              what=f"one file, {format(nb, ',')}-byte sequential writes, then fsync (total)")
    direct = direct_write(os.path.join(d, "direct.bin"), src, n * nb)
    if direct is not None:
        b.fig.add(size, "limits.file_write_direct", direct, n * nb, n,
                  what="one file, O_DIRECT writes of 8 MiB from an aligned buffer the blocks are "
                       "copied into, then fdatasync (the disk's durable pace, no page cache)")
    dst_t = touched((n * nb,))
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

    b.fig.add(size, "limits.file_read_warm", read_all(), n * nb, n)
    rows = dst_t.numpy().reshape(n, nb)
    fd = os.open(path, os.O_RDONLY)
    try:
        def read_checked(i: int) -> None:  # a block read, then every byte of it hashed
            view = memoryview(rows[i])
            if os.preadv(fd, [view], i * nb) != nb:
                raise RuntimeError(f"short read of block {i} of {path}")
            xxhash.xxh3_64_intdigest(view)

        b.fig.add(size, "limits.file_read_warm_checked", run_parallel(read_checked, n, 2), n * nb, n,
                  what="the same file, page cache warm: one preadv a block and xxh3 of it, 2 threads "
                       "(a read that checks every byte, as every restore must)")
    finally:
        os.close(fd)
    b.evictor.evict([path])
    fraction = resident_fraction([path])
    b.residency.setdefault(f"{size}.file_read_cold", []).append(fraction)
    if not_cold(fraction):
        b.fig.fail(size, "limits.file_read_cold", not_cold(fraction))
    b.fig.add(size, "limits.file_read_cold", read_all(), n * nb, n)
    shutil.rmtree(d, ignore_errors=True)
    del dst_t


def naive(b: Bench, size: str) -> None:
    # one intra-op thread: torch's OpenMP copies collapse when a core is busy (see
    # limits.torch_copy_default_threads), and the baseline should measure files, not that
    with torch_threads(1):
        _naive(b, size)


def _naive(b: Bench, size: str) -> None:
    blocks = b.data[size]
    n, nb = len(blocks), blocks[0].numel() * 2
    d_plain, d_sync = b.tmpdir("naive"), b.tmpdir("naive-sync")

    def save_plain(i: int) -> None:
        torch.save(blocks[i].clone(), os.path.join(d_plain, f"{i}.pt"))

    def save_sync(i: int) -> None:
        with open(os.path.join(d_sync, f"{i}.pt"), "wb") as fh:
            torch.save(blocks[i].clone(), fh)
            fh.flush()
            os.fsync(fh.fileno())

    b.fig.add(size, "limits.naive_save", run_parallel(save_plain, n, 1), n * nb, n,
              what="clone + torch.save per block, no fsync (torch 1 thread)")
    b.fig.add(size, "limits.naive_save_fsync", run_parallel(save_sync, n, 1), n * nb, n,
              what="clone + torch.save + fsync per block (torch 1 thread)")
    dst = touched((n, *blocks[0].shape), blocks[0].dtype)

    def load(i: int) -> None:
        dst[i].copy_(torch.load(os.path.join(d_sync, f"{i}.pt"), weights_only=True))

    b.fig.add(size, "limits.naive_load_warm", run_parallel(load, n, 1), n * nb, n,
              what="torch.load + copy_ into a tensor, per file (torch 1 thread)")
    files = files_under(d_sync)
    b.evictor.evict(files)
    fraction = resident_fraction(files)
    b.residency.setdefault(f"{size}.naive_load_cold", []).append(fraction)
    if not_cold(fraction):
        b.fig.fail(size, "limits.naive_load_cold", not_cold(fraction))
    b.fig.add(size, "limits.naive_load_cold", run_parallel(load, n, 1), n * nb, n,
              what="torch.load + copy_ into a tensor, per file, page cache dropped (1 thread)")
    assert torch.equal(dst[n - 1], blocks[n - 1]), "naive round trip differs"
    shutil.rmtree(d_plain, ignore_errors=True)
    shutil.rmtree(d_sync, ignore_errors=True)


def redis_py(b: Bench, size: str, rep: int, blobs: list[memoryview]) -> None:
    import redis

    blocks = b.data[size]
    n, nb = len(blocks), blocks[0].numel() * 2
    client = redis.Redis.from_url(b.redis_url, socket_timeout=30)
    prefix = f"bench-tiers:{b.run_id}:{size}:{rep}:".encode()
    keys = [prefix + b"raw:%d" % i for i in range(n)]
    ekeys = [prefix + b"enc:%d" % i for i in range(n)]
    payloads = [as_np(x).tobytes() for x in blocks]
    try:
        b.fig.add(size, "limits.redis_py_set",
                  run_parallel(lambda i: client.set(keys[i], payloads[i]), n, 1),
                  n * nb, n, what="redis-py SET of the raw payload, one at a time")
        got: list = [None] * n

        def get(i: int) -> None:
            got[i] = client.get(keys[i])

        b.fig.add(size, "limits.redis_py_get", run_parallel(get, n, 1), n * nb, n,
                  what="redis-py GET of the raw payload, one at a time")
        assert got[n - 1] == payloads[n - 1], "redis round trip differs"
        got = [None] * n
        # what the store ships: the encoded blobs (payload GB/s: raw bytes they carry)
        b.fig.add(size, "limits.redis_py_set_encoded",
                  run_parallel(lambda i: client.set(ekeys[i], blobs[i]), n, 1), n * nb, n,
                  what="redis-py SET of the store-encoded blobs, one at a time (payload GB/s)")
        b.fig.add(size, "limits.redis_py_get_encoded",
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

        b.fig.add(size, "limits.redis_py_set_pipelined32", pipelined("set"), n * nb, n)
        b.fig.add(size, "limits.redis_py_get_pipelined32", pipelined("get"), n * nb, n)
    finally:
        client.delete(*keys, *ekeys)
        client.close()
    if b.redis is not None:  # (our own server: its key:* keys are redis-benchmark's)
        figures = redis_benchmark("127.0.0.1", b.redis.port, nb, n)
        fresh = redis_benchmark("127.0.0.1", b.redis.port, nb, n, fresh_keys=True)
        figures.update({k if k != "error" else "error_new_keys": v for k, v in fresh.items()})
        cleaner = redis.Redis.from_url(b.redis_url, socket_timeout=30)
        try:
            made = list(cleaner.scan_iter(match="key:*", count=1000))
            for lo in range(0, len(made), 1000):
                cleaner.unlink(*made[lo:lo + 1000])
        finally:
            cleaner.close()
        b.redis_bench.setdefault(size, []).append(figures)
