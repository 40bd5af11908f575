"""Where bench_e2e's TTFT goes: ``Probe`` wraps the engine's, scheduler's, store's, LMDB
backend's, codec's and connector worker's methods (``internals.probe_points``) and sums the wall
time of each over the steps up to the first token, transfer-pool threads included. Installed
only in the TTFT children."""

from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict
from typing import Any


class Probe:
    """Wall time per wrapped method, summed over calls (and over transfer-pool threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.active = False
        self.missing: list[str] = []

    def wrap(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name, None)
        if original is None:
            self.missing.append(f"{owner.__name__}.{name}")
            return
        probe = self

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if not probe.active:
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                with probe.lock:
                    probe.seconds[label] += elapsed
                    probe.calls[label] += 1

        setattr(owner, name, timed)

    def install(self) -> Probe:
        from .internals import probe_points

        for owner, name, label in probe_points():
            self.wrap(owner, name, label)
        return self

    def start(self) -> None:
        with self.lock:
            self.seconds.clear()
            self.calls.clear()
        self.active = True

    def stop(self) -> dict:
        self.active = False
        with self.lock:
            out = {k: round(v * 1e3, 2) for k, v in sorted(self.seconds.items())}
            calls = dict(self.calls)
        if "pool_tier_read" in out and "pool_decode" in out:
            out["pool_lmdb_read_excl_decode"] = round(out["pool_tier_read"] - out["pool_decode"], 2)
        out["calls"] = {k: calls[k] for k in ("pool_load_jobs", "pool_decode", "step") if k in calls}
        return out
