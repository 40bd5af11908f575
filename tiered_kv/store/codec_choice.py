"""The ``auto`` codec: raw bodies or ``zstd+shuffle``, chosen for this machine when a store opens.

Compression is worth its CPU only where it is not the slowest step. A write-behind that
compresses moves at most (threads x per-thread compress rate) bytes of payload a second; raw
bodies move at what the medium takes (a page cache or an NVMe drive: several GB/s). On a
2-vCPU host, byte-shuffled zstd-1 compresses ~0.7-1.0 GB/s per thread, so two threads give
~1.5-1.9 GB/s against ~2.5-5 GB/s for raw puts, and decoding (~2.4 GB/s per thread) caps a warm
restore far below a copy's ~10 GB/s: raw wins every column but the disk space (and a cold read
from a slow disk). With eight or more threads compressing it keeps up with the medium, stores
1.4x more in the same bytes, and a cold restore reads 1.4x fewer bytes from disk.

So ``auto`` measures the shuffled compress rate once per process on a KV-like sample (a few
milliseconds) and compresses when ``min(workers, usable CPUs) x rate >= COMPRESS_WHEN_GBPS``.
An explicit ``raw`` / ``zstd`` / ``zstd+shuffle`` is always kept. Readers decode every codec
whatever the setting: a tier may hold blocks of several.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np

from tiered_kv.store.codec import BlockCodec

log = logging.getLogger(__name__)

AUTO = "auto"
COMPRESSED = "zstd+shuffle"
COMPRESS_WHEN_GBPS = 4.0  # compress when the write-behind compresses at least this fast
SAMPLE_BYTES = 1 << 20  # of bf16 KV-like data, compressed to measure the rate
SAMPLE_ROUNDS = 3  # the best of these is the rate (a busy core only ever slows a round)

_lock = threading.Lock()
_rate: list[float] = []  # GB/s per thread, measured once


CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "<quota> <period>" or "max <period>"


def usable_cpus(cpu_max: str = CPU_MAX) -> int:
    """CPUs this process may run on: its affinity, bounded by a cgroup CPU quota (a container
    limited to two CPUs' time on a 64-core host compresses like a 2-CPU machine)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        with open(cpu_max) as fh:
            quota, period = fh.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota readable: the affinity it is
    return cpus


def sample_block(nbytes: int = SAMPLE_BYTES) -> np.ndarray:
    """KV-like bf16 bytes: normal values with a scale per channel (a head dim of 128)."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal((nbytes // 256, 128), dtype=np.float32)
    values *= rng.lognormal(0.0, 1.0, 128).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype("<u2").reshape(-1)  # float32 -> bfloat16 bits


def compress_rate() -> float:
    """Payload GB/s of one thread compressing with ``zstd+shuffle`` (measured once)."""
    with _lock:
        if not _rate:
            payload = sample_block()
            codec = BlockCodec(COMPRESSED)
            best = float("inf")
            for _ in range(SAMPLE_ROUNDS):
                start = time.perf_counter()
                codec.encode(payload, dtype="bfloat16", shape=(payload.size,), namespace=bytes(16), key=bytes(16))
                best = min(best, time.perf_counter() - start)
            _rate.append(payload.nbytes / max(best, 1e-9) / 1e9)
        return _rate[0]


def choose(codec: str, workers: int, *, cpus: int | None = None, rate: float | None = None) -> str:
    """The codec a tier configured with ``codec`` writes: ``auto`` resolved for this machine
    (``cpus`` and the per-thread ``rate`` measured unless given), any other kept."""
    if codec != AUTO:
        return codec
    threads = max(1, min(workers, usable_cpus() if cpus is None else cpus))
    per_thread = compress_rate() if rate is None else rate
    chosen = COMPRESSED if threads * per_thread >= COMPRESS_WHEN_GBPS else "raw"
    log.info("codec auto: %d threads x %.2f GB/s compressing (%s %.1f GB/s): %s", threads, per_thread,
             ">=" if chosen == COMPRESSED else "<", COMPRESS_WHEN_GBPS, chosen)
    return chosen
