"""The ``auto`` codec: raw bodies or ``zstd+shuffle``, chosen for this machine when a store opens.

Compression is worth its CPU only where it is not the slowest step, of the write-behind or of a
restore. A write-behind that compresses moves at most (threads x per-thread compress rate) bytes
of payload a second, and a restore that decodes at most (threads x per-thread decode rate); raw
bodies move at what the medium takes and gives (a page cache: ~3-5 GB/s written, 10-17 GB/s read
back on the hosts measured; an NVMe drive: several GB/s). On a 2-vCPU host byte-shuffled zstd-1
compresses 0.7-2.2 GB/s and decodes 1.9-2.7 GB/s per thread (by the CPU), so two threads cap a
warm restore at ~4 GB/s against ~9-13 GB/s raw (this VM, 2026-11-26: 3.7-3.8 against 7.1-13.3):
raw wins every column but the disk space (and a cold read from a slow disk). With eight or more
threads compression keeps up with both, stores 1.4x more in the same bytes, and a cold restore
reads 1.4x fewer bytes from disk.

So ``auto`` measures the shuffled compress and decode rates once per process and frame size on a
KV-like sample (a few milliseconds) cut into frames of the size the tier compresses (a block, or
its smallest layer group): each frame has fixed work (a header, checks, a zstd context), which on
small frames outweighs the bytes (one thread here: ~1.3-2.2 GB/s in frames of 64 KiB to 1 MiB, ~0.8 in 16 KiB,
~0.3 in 4 KiB). It compresses when ``min(workers, usable CPUs) x compress rate >=
COMPRESS_WHEN_GBPS`` and ``... x decode rate >= DECODE_WHEN_GBPS``. An explicit ``raw`` / ``zstd`` / ``zstd+shuffle``
is always kept. Readers decode every codec whatever the setting: a tier may hold blocks of several."""

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
DECODE_WHEN_GBPS = 10.0  # ... and restores decode at least this fast (a page-cache read's pace)
SAMPLE_BYTES = 1 << 20  # of bf16 KV-like data, compressed to measure the rate
SAMPLE_ROUNDS = 3  # the best of these is the rate (a busy core only ever slows a round)
MIN_FRAME = 256  # bytes: the smallest frame measured

_lock = threading.Lock()
_rates: dict[int, tuple[float, float]] = {}  # frame bytes -> (compress, decode) GB/s per thread, measured once


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


def compress_rate(frame_bytes: int = SAMPLE_BYTES) -> float:
    """Payload GB/s of one thread compressing with ``zstd+shuffle`` in frames of ``frame_bytes``
    (at most SAMPLE_BYTES; measured once per size)."""
    return _measured(frame_bytes)[0]


def decode_rate(frame_bytes: int = SAMPLE_BYTES) -> float:
    """Payload GB/s of one thread checking and decoding those frames into a buffer of its own."""
    return _measured(frame_bytes)[1]


def _measured(frame_bytes: int) -> tuple[float, float]:
    """(compress, decode) GB/s per thread in frames of ``frame_bytes``, each the best of
    SAMPLE_ROUNDS (a busy core only ever slows a round)."""
    frame = max(MIN_FRAME, min(int(frame_bytes), SAMPLE_BYTES)) // 2 * 2
    with _lock:
        if frame not in _rates:
            payload = sample_block()
            frames = [payload[i : i + frame // 2] for i in range(0, payload.size - frame // 2 + 1, frame // 2)]
            codec, named = BlockCodec(COMPRESSED), {"namespace": bytes(16), "key": bytes(16)}
            blobs: list = []

            def compress() -> None:
                blobs[:] = [codec.encode(part, dtype="bfloat16", shape=(part.size,), **named) for part in frames]

            out = bytearray(frame)

            def decode() -> None:
                for blob in blobs:
                    codec.decode(blob, out=out, **named)

            _rates[frame] = (len(frames) * frame / _best(compress) / 1e9, len(frames) * frame / _best(decode) / 1e9)
        return _rates[frame]


def _best(step) -> float:
    """The shortest of SAMPLE_ROUNDS runs of ``step``, in seconds."""
    best = float("inf")
    for _ in range(SAMPLE_ROUNDS):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def choose(codec: str, workers: int, *, frame_bytes: int = SAMPLE_BYTES, cpus: int | None = None,
           rate: float | None = None, decode: float | None = None) -> str:
    """The codec a tier configured with ``codec`` writes: ``auto`` resolved for this machine
    and frames of ``frame_bytes`` (``cpus`` and the per-thread compress ``rate`` and ``decode``
    rate measured unless given), any other kept."""
    if codec != AUTO:
        return codec
    threads = max(1, min(workers, usable_cpus() if cpus is None else cpus))
    per_thread = compress_rate(frame_bytes) if rate is None else rate
    decoding = decode_rate(frame_bytes) if decode is None else decode
    keeps_up = threads * per_thread >= COMPRESS_WHEN_GBPS and threads * decoding >= DECODE_WHEN_GBPS
    chosen = COMPRESSED if keeps_up else "raw"
    log.info("codec auto: %d threads x %.2f GB/s compressing (needs %.1f in all), x %.2f GB/s decoding "
             "(needs %.1f in all): %s",
             threads, per_thread, COMPRESS_WHEN_GBPS, decoding, DECODE_WHEN_GBPS, chosen)
    return chosen
