#!/usr/bin/env python
"""Two properties of this machine that move the disk figures, measured (not timed by tests).

    python tools/probe_vm_memory.py [--mib N] [--repeats R] [--dir DIR] [--json]

1. The kernel's copy between a user buffer and the page cache, by where the destination sits
   against the source within a 4 KiB page (``(destination - source) mod 4096``: the buffer
   against the file offset for ``pread``, the other way round for ``pwrite``): on some CPUs
   (this AMD EPYC VM) both run at full pace only when that offset is a multiple of 32 bytes;
   8-24 bytes past runs at a quarter to a half of it, other offsets at about 0.7. So the LMDB
   tier's whole-value reads land at their file offset's place in a page
   (``storage_backends/lmdb_values``), and a segment value ends on a multiple of 64 bytes,
   which puts a raw block's payload on a cache line of the file, as host slots and torch
   tensors are (``storage_backends/segment_io``).
2. A page-cache write of N MiB right after N MiB of page cache was freed (the freed pages are
   reused), against the same write after the process first allocated and zeroed N MiB of its own
   (what a new store's host tier does): on a VM whose free memory goes back to the hypervisor,
   the second write takes fresh pages, each a fault on the host.

Each figure is a median of ``--repeats`` runs, GB/s of payload; ratios are within this run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

PAGE = 4096
PHASES = (0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 96, 2048, 2056, 4064, 4088)  # (destination - source) mod 4096


def copy_rates(directory: str, mib: int, repeats: int) -> dict[str, dict[int, float]]:
    """pread and pwrite GB/s of 2 MiB pieces of a file in the page cache, by page phase of the
    destination against the source."""
    piece, count = 2 << 20, max(1, mib // 2)
    path = os.path.join(directory, "phases")
    buf = np.ones(count * piece + 2 * PAGE, np.uint8)
    base = -buf.ctypes.data % PAGE  # index of the first page-aligned byte
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, memoryview(buf)[: count * piece + PAGE], 0)  # every page cached
        out: dict[str, dict[int, float]] = {"pread": {}, "pwrite": {}}
        for phase in PHASES:
            for op in out:  # a read's destination is the buffer, a write's the file
                at = base + (phase if op == "pread" else -phase % PAGE)
                view = memoryview(buf)[at : at + count * piece]
                runs = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    for i in range(count):
                        part = view[i * piece : (i + 1) * piece - PAGE]
                        if op == "pread":
                            os.preadv(fd, [part], i * piece)
                        else:
                            os.pwrite(fd, part, i * piece)
                    runs.append(count * (piece - PAGE) / (time.perf_counter() - start) / 1e9)
                out[op][phase] = round(statistics.median(runs), 2)
        return out
    finally:
        os.close(fd)
        os.unlink(path)


def write_after(directory: str, mib: int, allocate_first: bool, data: memoryview) -> float:
    """GB/s of one N MiB page-cache write into a new file, after freeing N MiB of page cache and
    (``allocate_first``) allocating and zeroing N MiB of anonymous memory."""
    freed = tempfile.mkdtemp(dir=directory)
    with open(os.path.join(freed, "f"), "wb") as f:
        f.write(data)
    shutil.rmtree(freed)  # its pages are free now
    slab = np.zeros(len(data), np.uint8) if allocate_first else None
    if slab is not None:
        slab[::PAGE] = 1  # every page touched (np.zeros may map the zero page lazily)
    target = tempfile.mkdtemp(dir=directory)
    try:
        fd = os.open(os.path.join(target, "f"), os.O_WRONLY | os.O_CREAT, 0o600)
        start = time.perf_counter()
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
        seconds = time.perf_counter() - start
        os.close(fd)
        return len(data) / seconds / 1e9
    finally:
        shutil.rmtree(target)
        del slab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="MiB per probe (default 512)")
    ap.add_argument("--repeats", type=int, default=5, help="repeats, medians reported (default 5)")
    ap.add_argument("--dir", default=None, help="a directory on the disk to probe (default: temp dir)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args()
    directory = tempfile.mkdtemp(prefix="tkv-vm-", dir=a.dir)
    try:
        rates = copy_rates(directory, a.mib, a.repeats)
        data = memoryview(np.random.default_rng(0).integers(0, 255, a.mib << 20, np.uint8))
        reused, fresh = [], []
        for _ in range(a.repeats):  # alternated, so both see the same minutes
            reused.append(write_after(directory, a.mib, False, data))
            fresh.append(write_after(directory, a.mib, True, data))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    report = {
        "copy_gbps_by_page_phase": rates,
        "slowest_vs_aligned": {op: round(min(v for p, v in r.items() if p % 32)
                                         / statistics.median(v for p, v in r.items() if not p % 32), 2)
                               for op, r in rates.items()},
        "page_cache_write_gbps": {"after_freeing": round(statistics.median(reused), 2),
                                  "after_freeing_then_allocating": round(statistics.median(fresh), 2),
                                  "runs_after_freeing": [round(x, 2) for x in reused],
                                  "runs_after_allocating": [round(x, 2) for x in fresh]},
    }
    if a.json:
        print(json.dumps(report, indent=1))
        return
    for op, r in rates.items():
        print(f"{op:7s} GB/s by (destination - source) mod 4096: " + ", ".join(f"{p}: {v}" for p, v in r.items()))
    print("slowest offset / median of the multiples of 32:", report["slowest_vs_aligned"])
    w = report["page_cache_write_gbps"]
    print(f"page-cache write of {a.mib} MiB: {w['after_freeing']} GB/s after freeing as much page cache, "
          f"{w['after_freeing_then_allocating']} GB/s when the process allocated as much first "
          f"(runs {w['runs_after_freeing']} / {w['runs_after_allocating']})")


if __name__ == "__main__":
    main()
