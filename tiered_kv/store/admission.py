"""Hit-count admission to the lower tiers: a block is written to a tier whose
``admit_after_hits`` is N only once it was requested N times (saved after being computed, or
loaded), so one-off prompts never wear an SSD.

Requests are counted per key in this process, in a bounded table (least recently counted keys
are forgotten first; a forgotten key counts from zero again, and tiers that admit at once never
look at counts). A block earns a tier at whichever request reaches the tier's N: a save, a load
served by the host tier, or a load promoted from another tier; the table remembers which tiers
a key was queued for, so a block that keeps being requested is written behind once. Writes a
tier did not admit are counted as ``admission_skipped``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

MAX_TRACKED = 1 << 18  # keys whose request counts are kept (~60 MiB at most)


class RequestCounts:
    """How often each block key was requested, and which lower tiers it was queued for."""

    def __init__(self, thresholds: Sequence[int], max_tracked: int = MAX_TRACKED) -> None:
        self.active = max(thresholds, default=1) > 1  # whether any tier waits for more requests
        self.max_tracked = max_tracked
        self._lock = threading.Lock()
        self._table: OrderedDict[bytes, list] = OrderedDict()  # key -> [requests, tier names queued]

    def request(self, keys: Sequence[bytes]) -> list[int]:
        """Count one request of each key; the counts after it."""
        if not self.active:
            return [1] * len(keys)
        out = []
        with self._lock:
            for key in keys:
                entry = self._table.pop(key, None) or [0, frozenset()]
                entry[0] += 1
                self._table[key] = entry
                out.append(entry[0])
            while len(self._table) > self.max_tracked:
                self._table.popitem(last=False)
        return out

    def counts(self, keys: Sequence[bytes]) -> list[int]:
        """The request counts of ``keys`` so far (0 for keys never requested or forgotten)."""
        if not self.active:
            return [1] * len(keys)
        with self._lock:
            return [(e := self._table.get(k)) and e[0] or 0 for k in keys]

    def claim(self, key: bytes, names: Sequence[str], fresh_only: bool) -> list[str]:
        """Record that ``key`` is queued for the tiers ``names``; with ``fresh_only`` only those
        it was not queued for before are returned (and recorded)."""
        if not self.active or not names:
            return list(names)
        with self._lock:
            entry = self._table.get(key)
            if entry is None:
                return list(names)
            done = entry[1]
            out = [n for n in names if n not in done] if fresh_only else list(names)
            entry[1] = done | frozenset(out)
            return out

    def release(self, keys: Sequence[bytes], names: Sequence[str]) -> None:
        """Forget that ``keys`` were queued for the tiers ``names``: their write was dropped or
        refused, and a later request must be able to queue them again (a claim kept would keep a
        block that is requested again and again out of the tier for as long as the host holds it)."""
        if not self.active or not names or not keys:
            return
        gone = frozenset(names)
        with self._lock:
            for key in keys:
                entry = self._table.get(key)
                if entry is not None:
                    entry[1] = entry[1] - gone
