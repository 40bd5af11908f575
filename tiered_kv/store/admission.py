"""Hit-count admission to the lower tiers: a block is written to a tier whose
``admit_after_hits`` is N only once it was requested N times (saved after being computed, or
loaded), so one-off prompts never wear an SSD.

Requests are counted per key in this process, in a bounded table (least recently counted keys
are forgotten first). Keys a tier skipped are counted as ``admission_skipped`` in the store's
events; a load that brings a host-resident block to N writes it behind then.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

MAX_TRACKED = 1 << 18  # keys whose request counts are kept (~40 MiB at most)


class RequestCounts:
    """How often each block key was requested, for the tiers that admit after N requests."""

    def __init__(self, thresholds: Sequence[int], max_tracked: int = MAX_TRACKED) -> None:
        self.needed = max(thresholds, default=1)
        self.cap = self.needed + 1  # counts stop here: "reached N" happens once per key
        self.max_tracked = max_tracked
        self._lock = threading.Lock()
        self._counts: OrderedDict[bytes, int] = OrderedDict()

    @property
    def active(self) -> bool:
        """Whether any tier admits only after more than one request."""
        return self.needed > 1

    def request(self, keys: Sequence[bytes]) -> list[int]:
        """Count one request of each key; the counts after it."""
        if not self.active:
            return [1] * len(keys)
        out = []
        with self._lock:
            for key in keys:
                n = min(self._counts.pop(key, 0) + 1, self.cap)
                self._counts[key] = n
                out.append(n)
            while len(self._counts) > self.max_tracked:
                self._counts.popitem(last=False)
        return out

    def counts(self, keys: Sequence[bytes]) -> list[int]:
        """The request counts of ``keys`` so far (0 for keys never requested)."""
        if not self.active:
            return [1] * len(keys)
        with self._lock:
            return [self._counts.get(k, 0) for k in keys]
