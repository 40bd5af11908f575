"""Counters of the store and connector: hits, misses by reason, bytes, latency, drops.

Thread-safe and cheap (one lock, plain ints). ``snapshot()`` gives a plain dict; the Prometheus
exporter and the CLI read that. Evictions are not counted here: a medium evicts on its own and
counts them itself (``BackendStats.evictions``, in ``TieredStore.stats()["backends"]``); a
counter here was never moved and showed 0 beside the medium's real figure.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class TierCounters:
    hits: int = 0  # blocks served from this tier
    misses: Counter = field(default_factory=Counter)  # reason -> blocks not served from here
    blocks_in: int = 0  # blocks written into this tier
    blocks_out: int = 0  # blocks read out of this tier
    bytes_in: int = 0  # payload (uncompressed) bytes written
    bytes_out: int = 0  # payload (uncompressed) bytes read
    stored_bytes_in: int = 0  # bytes as stored (compressed) written
    seconds_in: float = 0.0  # time spent writing
    seconds_out: float = 0.0  # time spent reading


class StoreMetrics:
    """All counters of one TieredStore."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.tiers: dict[str, TierCounters] = defaultdict(TierCounters)
        self.events: Counter = Counter()  # store-wide: saves_dropped, loads_failed, ...
        self.gauges: dict[str, float] = {}

    def hit(self, tier: str, blocks: int = 1, nbytes: int = 0, seconds: float = 0.0) -> None:
        with self._lock:
            t = self.tiers[tier]
            t.hits += blocks
            t.blocks_out += blocks
            t.bytes_out += nbytes
            t.seconds_out += seconds

    def miss(self, tier: str, reason: str, blocks: int = 1) -> None:
        with self._lock:
            self.tiers[tier].misses[reason] += blocks

    def wrote(self, tier: str, blocks: int, nbytes: int, stored: int, seconds: float) -> None:
        with self._lock:
            t = self.tiers[tier]
            t.blocks_in += blocks
            t.bytes_in += nbytes
            t.stored_bytes_in += stored
            t.seconds_in += seconds

    def event(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.events[name] += n

    def gauge(self, name: str, value: float) -> None:
        with self._lock:
            self.gauges[name] = value

    def misses(self, reason: str | None = None) -> int:
        """Blocks missed for ``reason`` over all tiers (all reasons when None)."""
        with self._lock:
            return sum(sum(t.misses.values()) if reason is None else t.misses[reason]
                       for t in self.tiers.values())

    @contextmanager
    def timer(self):
        box = [0.0]
        start = time.perf_counter()
        try:
            yield box
        finally:
            box[0] = time.perf_counter() - start

    def snapshot(self) -> dict:
        with self._lock:
            tiers = {}
            for name, t in self.tiers.items():
                tiers[name] = {
                    "hits": t.hits, "misses": dict(t.misses), "blocks_in": t.blocks_in,
                    "blocks_out": t.blocks_out, "bytes_in": t.bytes_in, "bytes_out": t.bytes_out,
                    "stored_bytes_in": t.stored_bytes_in, "seconds_in": round(t.seconds_in, 6),
                    "seconds_out": round(t.seconds_out, 6),
                }
            return {"tiers": tiers, "events": dict(self.events), "gauges": dict(self.gauges)}
