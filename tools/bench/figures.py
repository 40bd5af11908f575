"""How bench_tiers measures and records a figure: ``Figures`` keeps the seconds of every repeat
with the bytes and blocks each moved (and notes, errors, CPU cores) and turns them into medians
and GB/s; ``run_parallel`` times a per-block function on 1 or more threads; ``torch_threads``
holds torch's intra-op threads for a measurement."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch

from .common import GB, Stopwatch, log, median


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
