"""Small helpers both benchmarks share and that need neither torch nor numpy: units, the
progress log on stderr, medians, and a stopwatch of wall and process CPU time."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence

GB = 1e9
MiB = 1 << 20


def log(msg: str, tag: str = "bench") -> None:
    """One progress line on stderr, e.g. ``[bench 12:00:00] msg``."""
    print(f"[{tag} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median(xs: Sequence[float]) -> float | None:
    """Median of the values that are not None; None when there are none."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def median_or_nan(xs: Sequence[float]) -> float:
    """Median, NaN for an empty list."""
    m = median(xs)
    return float("nan") if m is None else m


class Stopwatch:
    """Wall seconds and this process's CPU seconds (all threads) since it was made."""

    def __init__(self) -> None:
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()

    def lap(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall0, time.process_time() - self.cpu0
